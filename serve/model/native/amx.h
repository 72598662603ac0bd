// AMX tiles for the GEMMs' row tiles of 16 rows (AVX-512 builds, CPUs with AMX-INT8).
//
// The packed weight layouts (gemm.h) are already AMX's B-tile layout: a 64-byte chunk holds 16
// columns by 4 consecutive inputs. One TDPBSUD (Q4: signed activations, unsigned codes) or
// TDPBSSD (Q8) gives a block's exact integer dots for 16 rows by 16 columns; the float pass
// after it is the VNNI kernel's, operation for operation, so the bits are the same whichever
// path a row takes. Each block has its own scales, so every block's dots leave the tile unit
// through a tile store: two accumulator tiles alternate, so the unit works on the next block
// while the vector unit scales this one.
//
// Linux gives a process the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM); each
// thread loads the tile configuration before its first tile instruction of a library call.
#pragma once

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__GNUC__) && \
    (defined(__clang__) || __GNUC__ >= 11)
#define OSD_AMX 1

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

#include <immintrin.h>

namespace osd {

constexpr int kAmxRows = 16;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Whether this CPU and kernel let the process use AMX-INT8 (asked once).
inline bool amx_supported() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 25))) return false;  // AMX-TILE, AMX-INT8
    constexpr long kReqPerm = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kReqPerm, kTileData) == 0;
  }();
  return ok;
}

// The rows from which the GEMMs take AMX row tiles (0: never); set by osd_set_amx.
inline std::atomic<int>& amx_min_rows() {
  static std::atomic<int> rows{0};
  return rows;
}

// Bumped at the start of every library call: a thread loads the tile configuration once per
// call, since between calls other code on the same thread (oneDNN's AMX kernels, under torch)
// may load its own or release the tiles.
inline std::atomic<uint64_t>& amx_epoch() {
  static std::atomic<uint64_t> epoch{0};
  return epoch;
}

// tmm0, tmm1: accumulators (16 x 16 int32); tmm2, tmm3: activations (16 rows x 32 bytes);
// tmm4, tmm5: weights (8 rows x 64 bytes).
__attribute__((target("amx-tile"))) inline void amx_configure() {
  thread_local uint64_t loaded = 0;
  const uint64_t now = amx_epoch().load(std::memory_order_relaxed);
  if (loaded == now) return;
  // Static: ldtilecfg's asm names only the config's first bytes as its input, so the stores
  // to a local one could be dropped as dead.
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int t = 0; t < 2; ++t) c.rows[t] = 16, c.colsb[t] = 64;
    for (int t = 2; t < 4; ++t) c.rows[t] = 16, c.colsb[t] = 32;
    for (int t = 4; t < 6; ++t) c.rows[t] = 8, c.colsb[t] = 64;
    return c;
  }();
  _tile_loadconfig(&cfg);
  loaded = now;
}

// A Q4 block's codes as B-tile rows (input groups in order: low nibbles of chunk j are inputs
// 8j..8j+3, high nibbles 8j+4..8j+7).
inline void q4_unpack(const uint8_t* blk, uint8_t* out) {
  const __m512i low = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const __m512i raw = _mm512_loadu_si512(blk + 64 * j);
    _mm512_store_si512(out + 128 * j, _mm512_and_si512(raw, low));
    _mm512_store_si512(out + 128 * j + 64, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
  }
}

// The VNNI kernels' float pass (gemm.h q4_block, q8_block) for one block of R rows, from the
// stored integer dots.
template <bool Q4, int R>
inline void amx_scale(const int32_t* dots, const uint8_t* blk, const Act& a, int r0, int b, __m512* acc) {
  const int kb = a.k / kBlock;
  const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (Q4 ? 256 : 512))));
  const __m512 mw = Q4 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)))
                       : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const int64_t ab = static_cast<int64_t>(r0 + r) * kb + b;
    const __m512i d = _mm512_load_si512(dots + 16 * r);
    acc[r] = Q4 ? q4_block(acc[r], d, dw, mw, a.d[ab], a.s[ab]) : q8_block(acc[r], d, dw, a.d[ab]);
  }
}

// Block b's dots into accumulator tile C, from activation tile A and weight tile B (a Q4
// block's codes unpacked into its stage slot an iteration earlier). A macro: the tile
// intrinsics take their register numbers as literal tokens.
#define OSD_AMX_BLOCK(C, A, B, b)                                                           \
  do {                                                                                      \
    _tile_zero(C);                                                                          \
    _tile_loadd(A, xq + (b) * kBlock, a.k);                                                 \
    if constexpr (Q4) {                                                                     \
      _tile_loadd(B, stage[(b) & 3], 64);                                                   \
      _tile_dpbsud(C, A, B);                                                                \
    } else {                                                                                \
      _tile_loadd(B, w + static_cast<int64_t>(b) * kQ8Bytes, 64);                           \
      _tile_dpbssd(C, A, B);                                                                \
    }                                                                                       \
  } while (0)

// Rows [r0, r0 + R) by one weight tile of 16 columns, R <= 16. The activation tile always
// reads 16 rows (quantized activations keep 15 rows of slack past their last); the dots of
// rows past R are not used. A pipeline over blocks: block b's dots leave their tile while
// block b + 1 multiplies, and are scaled an iteration later.
template <bool Q4, int R>
__attribute__((target("amx-tile,amx-int8"))) inline void amx_tile(const uint8_t* w, int blocks, const Act& a, int r0,
                                                                  float* y, int ldy, bool add, const uint8_t* next) {
  constexpr int bytes = Q4 ? kQ4Bytes : kQ8Bytes;
  alignas(64) uint8_t stage[4][512];
  alignas(64) int32_t dots[2][kAmxRows * kTile];
  auto unpack = [&](int b) {
    if (Q4 && b < blocks) q4_unpack(w + static_cast<int64_t>(b) * bytes, stage[b & 3]);
  };
  const int8_t* xq = a.q + static_cast<int64_t>(r0) * a.k;
  auto scale = [&](int b, __m512* acc) { amx_scale<Q4, R>(dots[b & 1], w + static_cast<int64_t>(b) * bytes, a, r0, b, acc); };
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  unpack(0), unpack(1), unpack(2);
  OSD_AMX_BLOCK(0, 2, 4, 0);
  if (blocks > 1) OSD_AMX_BLOCK(1, 3, 5, 1);
  for (int b = 0; b < blocks; b += 2) {  // tile 0 holds even blocks, tile 1 odd ones
    prefetch_block<bytes>(next, b);
    unpack(b + 3);
    _tile_stored(0, dots[0], 64);
    if (b + 2 < blocks) OSD_AMX_BLOCK(0, 2, 4, b + 2);
    if (b > 0) scale(b - 1, acc);
    if (b + 1 >= blocks) break;
    prefetch_block<bytes>(next, b + 1);
    unpack(b + 4);
    _tile_stored(1, dots[1], 64);
    if (b + 3 < blocks) OSD_AMX_BLOCK(1, 3, 5, b + 3);
    scale(b, acc);
  }
  scale(blocks - 1, acc);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) store16(y + static_cast<int64_t>(r0 + r) * ldy, acc[r], add);
}

#undef OSD_AMX_BLOCK

// amx_tile for `rows` rows (1 to R), one instantiation per row count.
template <int R, bool Q4>
inline void amx_rows(const uint8_t* w, int blocks, const Act& a, int r0, int rows, float* y, int ldy, bool add,
                     const uint8_t* next) {
  if constexpr (R > 0) {
    if (rows == R) amx_tile<Q4, R>(w, blocks, a, r0, y, ldy, add, next);
    else amx_rows<R - 1, Q4>(w, blocks, a, r0, rows, y, ldy, add, next);
  }
}

}  // namespace osd

#endif
