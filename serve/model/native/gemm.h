// Small-M GEMMs over packed 4-bit and 8-bit weights with int8 activations.
//
// Weights are packed in tiles of 16 output columns by 32 inputs (serve/model/native_formats.py):
//   Q4 tile-block, 320 bytes: 4 chunks of 64 bytes, chunk j byte (4c + i) holding column c's
//     code at input 8j + i (low nibble) and 8j + 4 + i (high nibble); then 16 scales d and
//     16 minima m as float16. w = d * code + m, codes 0..15 (the GGUF's Q4_1 blocks).
//   Q8 tile-block, 576 bytes: 8 chunks of 64 bytes, chunk g byte (4c + i) holding column c's
//     int8 weight at input 4g + i; then 16 scales d (float16) and 16 sums of the block's codes
//     (int16), which undo the +128 shift of the activations in the VNNI path.
// Activations are quantized per row in blocks of 32 (as llama.cpp's Q8_1): q = round(x / d),
// d = max|x| / 127, with s = d * sum(q) for the Q4 minima.
//
// Every path computes each block's integer dot exactly and then the same float operations in
// the same order, so a row's result does not depend on the other rows in the call, nor on
// the instruction set: AVX-512, AVX2 and the scalar code give identical bits, and so do the
// AMX tiles (amx.h) that the AVX-512 build uses for calls of amx_min_rows() rows or more.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <immintrin.h>

#include "ops.h"

namespace osd {

constexpr int kBlock = 32;
constexpr int kTile = 16;
constexpr int kQ4Bytes = 320;
constexpr int kQ8Bytes = 576;
constexpr int kRowSlack = 15;  // rows readable past an activation's last (amx.h)

struct Act {  // M quantized rows of K inputs
  const int8_t* q;  // [M + kRowSlack, K]
  const float* d;   // [M, K / 32]
  const float* s;   // [M, K / 32]
  int k;
};

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 31, man = h & 1023;
  uint32_t bits;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in float
    float v = static_cast<float>(man) * 5.9604644775390625e-08f;
    std::memcpy(&bits, &v, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
#endif
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// A block's scale from its 16 lanes of running maxima: the same sequence of maxima as one
// running max over the block, so every path below gives the same scale.
inline float block_amax(const float* lanes) {
  float amax = 0.f;
  for (int l = 0; l < kLanes; ++l) amax = fmax_(amax, lanes[l]);
  return amax;
}

// Row r of x [M, K] (row stride ldx) into q/d/s at row r.
inline void quantize_row_scalar(const float* x, int k, int8_t* q, float* d, float* s) {
  for (int b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    // The max in 16 lanes, then across them: the same value as one running max, without
    // its chain of 32 dependent steps.
    float lanes[kLanes] = {};
    for (int h = 0; h < kBlock; h += kLanes)
      for (int l = 0; l < kLanes; ++l) lanes[l] = fmax_(lanes[l], std::fabs(xb[h + l]));
    const float amax = block_amax(lanes);
    const float scale = amax / 127.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
      q[b * kBlock + i] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b] = scale;
    s[b] = scale * static_cast<float>(sum);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// quantize_row_scalar's operations on 16 lanes at once: the same bits (the compiler leaves
// the scalar loop's lane maxima scalar).
inline void quantize_row(const float* x, int k, int8_t* q, float* d, float* s) {
  for (int b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + kLanes);
    alignas(64) float lanes[kLanes];
    _mm512_store_ps(lanes, _mm512_max_ps(_mm512_max_ps(_mm512_setzero_ps(), _mm512_abs_ps(x0)), _mm512_abs_ps(x1)));
    const float amax = block_amax(lanes);
    const float scale = amax / 127.f;
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i v0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(x0, inv), kNearest));
    const __m512i v1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(x1, inv), kNearest));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock), _mm512_cvtepi32_epi8(v0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + kLanes), _mm512_cvtepi32_epi8(v1));
    d[b] = scale;
    s[b] = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1)));
  }
}
#elif defined(__AVX2__)
inline void quantize_row(const float* x, int k, int8_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    __m256 xs[4];
    for (int h = 0; h < 4; ++h) xs[h] = _mm256_loadu_ps(xb + 8 * h);
    alignas(32) float lanes[kLanes];
    for (int h = 0; h < 2; ++h)  // lanes 8h..8h+7 see inputs 8h.. and 16 + 8h..
      _mm256_store_ps(lanes + 8 * h, _mm256_max_ps(_mm256_max_ps(_mm256_setzero_ps(), _mm256_andnot_ps(sign, xs[h])),
                                                   _mm256_andnot_ps(sign, xs[h + 2])));
    const float amax = block_amax(lanes);
    const float scale = amax / 127.f;
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    alignas(32) int32_t v[kBlock];
    __m256i sum = _mm256_setzero_si256();
    for (int h = 0; h < 4; ++h) {
      const __m256i vi = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(xs[h], inv), kNearest));
      _mm256_store_si256(reinterpret_cast<__m256i*>(v + 8 * h), vi);
      sum = _mm256_add_epi32(sum, vi);
    }
    for (int i = 0; i < kBlock; ++i) q[b * kBlock + i] = static_cast<int8_t>(v[i]);
    alignas(32) int32_t part[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(part), sum);
    int total = 0;
    for (int i = 0; i < 8; ++i) total += part[i];
    d[b] = scale;
    s[b] = scale * static_cast<float>(total);
  }
}
#else
inline void quantize_row(const float* x, int k, int8_t* q, float* d, float* s) { quantize_row_scalar(x, k, q, d, s); }
#endif

// Block b of the next weight tile into L2 (null: nothing to fetch). Asked one tile ahead
// (6-15 KB), it keeps a core's stream of weights in flight where the hardware prefetcher alone
// does not, as on Intel's server cores; calls of up to kSmallRows rows (8 on AVX-512, 4 on AVX2) ask
// only while prefetch_small() holds, which a runner measures at load (native_tuning.py).
inline std::atomic<bool>& prefetch_small() {
  static std::atomic<bool> on{true};
  return on;
}

template <int Bytes>
inline void prefetch_block(const uint8_t* next, int b) {
  if (!next) return;
  const char* p = reinterpret_cast<const char*>(next) + static_cast<int64_t>(b) * Bytes;
  for (int off = 0; off < Bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
}

// One column's float accumulation of one block, shared by the scalar path and the tails.
inline float q4_step(float acc, int32_t isum, float dw, float mw, float da, float sa) {
  acc = std::fma(static_cast<float>(isum), dw * da, acc);
  return std::fma(mw, sa, acc);
}

inline float q8_step(float acc, int32_t isum, float dw, float da) {
  return std::fma(static_cast<float>(isum), dw * da, acc);
}

// ---- scalar reference (also the path of builds with neither AVX2 nor AVX-512) ----

inline void q4_tile_scalar(const uint8_t* w, int blocks, const Act& a, int r0, int rows, float* y, int ldy,
                           bool add) {
  for (int r = r0; r < r0 + rows; ++r) {
    const int8_t* xq = a.q + static_cast<int64_t>(r) * a.k;
    for (int c = 0; c < kTile; ++c) {
      float acc = 0.f;
      for (int b = 0; b < blocks; ++b) {
        const uint8_t* blk = w + static_cast<int64_t>(b) * kQ4Bytes;
        uint16_t dh, mh;
        std::memcpy(&dh, blk + 256 + 2 * c, 2);
        std::memcpy(&mh, blk + 288 + 2 * c, 2);
        int32_t isum = 0;
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = blk[64 * j + 4 * c + i];
            isum += (byte & 15) * xq[b * kBlock + 8 * j + i] + (byte >> 4) * xq[b * kBlock + 8 * j + 4 + i];
          }
        const int64_t ab = static_cast<int64_t>(r) * (a.k / kBlock) + b;
        acc = q4_step(acc, isum, half_to_float(dh), half_to_float(mh), a.d[ab], a.s[ab]);
      }
      float* out = y + static_cast<int64_t>(r) * ldy + c;
      *out = add ? *out + acc : acc;
    }
  }
}

inline void q8_tile_scalar(const uint8_t* w, int blocks, const Act& a, int r0, int rows, float* y, int ldy,
                           bool add) {
  for (int r = r0; r < r0 + rows; ++r) {
    const int8_t* xq = a.q + static_cast<int64_t>(r) * a.k;
    for (int c = 0; c < kTile; ++c) {
      float acc = 0.f;
      for (int b = 0; b < blocks; ++b) {
        const uint8_t* blk = w + static_cast<int64_t>(b) * kQ8Bytes;
        uint16_t dh;
        std::memcpy(&dh, blk + 512 + 2 * c, 2);
        int32_t isum = 0;
        for (int g = 0; g < 8; ++g)
          for (int i = 0; i < 4; ++i)
            isum += static_cast<int8_t>(blk[64 * g + 4 * c + i]) * xq[b * kBlock + 4 * g + i];
        const int64_t ab = static_cast<int64_t>(r) * (a.k / kBlock) + b;
        acc = q8_step(acc, isum, half_to_float(dh), a.d[ab]);
      }
      float* out = y + static_cast<int64_t>(r) * ldy + c;
      *out = add ? *out + acc : acc;
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kIsa = 2;
constexpr int kRowTile = 8;  // 8 int and 8 float accumulators, with room for the codes
constexpr int kSmallRows = 8;

inline void store16(float* out, __m512 acc, bool add) {
  if (add) acc = _mm512_add_ps(_mm512_loadu_ps(out), acc);
  _mm512_storeu_ps(out, acc);
}

// One row's float pass over one block's exact integer dots (16 columns): the VNNI kernels and
// the AMX tiles (amx.h) both call these, so either path gives a row the same bits.
inline __m512 q4_block(__m512 acc, __m512i dots, __m512 dw, __m512 mw, float da, float sa) {
  const __m512 prod = _mm512_mul_ps(dw, _mm512_set1_ps(da));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), prod, acc);
  return _mm512_fmadd_ps(mw, _mm512_set1_ps(sa), acc);
}

inline __m512 q8_block(__m512 acc, __m512i dots, __m512 dw, float da) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(dw, _mm512_set1_ps(da)), acc);
}

// Rows innermost: R independent dpbusd chains, and each block's codes unpacked once for R rows.
template <int R>
inline void q4_tile(const uint8_t* w, int blocks, const Act& a, int r0, float* y, int ldy, bool add,
                    const uint8_t* next) {
  const int kb = a.k / kBlock;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + static_cast<int64_t>(b) * kQ4Bytes;
    prefetch_block<kQ4Bytes>(next, b);
    const int8_t* xq = a.q + static_cast<int64_t>(r0) * a.k + b * kBlock;
    __m512i is[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) is[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i raw = _mm512_loadu_si512(blk + 64 * j);
      const __m512i lo = _mm512_and_si512(raw, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        is[r] = _mm512_dpbusd_epi32(is[r], lo, _mm512_set1_epi32(load_i32(xq + r * a.k + 8 * j)));
        is[r] = _mm512_dpbusd_epi32(is[r], hi, _mm512_set1_epi32(load_i32(xq + r * a.k + 8 * j + 4)));
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256)));
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int64_t ab = static_cast<int64_t>(r0 + r) * kb + b;
      acc[r] = q4_block(acc[r], is[r], dw, mw, a.d[ab], a.s[ab]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) store16(y + static_cast<int64_t>(r0 + r) * ldy, acc[r], add);
}

template <int R>
inline void q8_tile(const uint8_t* w, int blocks, const Act& a, int r0, float* y, int ldy, bool add,
                    const uint8_t* next) {
  const int kb = a.k / kBlock;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + static_cast<int64_t>(b) * kQ8Bytes;
    prefetch_block<kQ8Bytes>(next, b);
    const int8_t* xq = a.q + static_cast<int64_t>(r0) * a.k + b * kBlock;
    __m512i is[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) is[r] = _mm512_setzero_si512();
    // dpbusd multiplies unsigned by signed: the activations go in shifted by +128, and
    // 128 * (the block's code sum) comes off again, exactly.
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m512i wv = _mm512_loadu_si512(blk + 64 * g);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        is[r] = _mm512_dpbusd_epi32(is[r], _mm512_xor_si512(_mm512_set1_epi32(load_i32(xq + r * a.k + 4 * g)), flip), wv);
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 512)));
    const __m512i corr = _mm512_slli_epi32(
        _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 544))), 7);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int64_t ab = static_cast<int64_t>(r0 + r) * kb + b;
      acc[r] = q8_block(acc[r], _mm512_sub_epi32(is[r], corr), dw, a.d[ab]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) store16(y + static_cast<int64_t>(r0 + r) * ldy, acc[r], add);
}

}  // namespace osd
#include "amx.h"
namespace osd {

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kIsa = 1;
// Up to 6 rows a pass (2 x 6 accumulators and the codes fill the 16 registers): a pass's
// fixed cost, the weights' unpacking and the float pass's loads, is about one row's, so a
// verify of 5 rows runs in one pass instead of 4 + 1 (docs/benchmarks.md, Zen 3).
constexpr int kRowTile = 6;
constexpr int kSmallRows = 4;

inline void store8(float* out, __m256 acc, bool add) {
  if (add) acc = _mm256_add_ps(_mm256_loadu_ps(out), acc);
  _mm256_storeu_ps(out, acc);
}

// Half h (columns 8h..8h+7) of a tile; R rows.
template <int R>
inline void q4_half(const uint8_t* w, int blocks, const Act& a, int r0, int h, float* y, int ldy, bool add,
                    const uint8_t* next) {
  const int kb = a.k / kBlock;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + static_cast<int64_t>(b) * kQ4Bytes;
    prefetch_block<kQ4Bytes>(next, b);
    // The block's pair sums add up in int16 and widen once: a pair is at most 2 * 15 * 127
    // (codes 0..15, activations within +-127), so the block's 8 pairs a lane stay below 2^15.
    __m256i s16[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) s16[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 4; ++j) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * h));
      const __m256i lo = _mm256_and_si256(raw, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = a.q + static_cast<int64_t>(r0 + r) * a.k + b * kBlock + 8 * j;
        const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(xq)));
        const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(xq + 4)));
        s16[r] = _mm256_add_epi16(s16[r], _mm256_add_epi16(pl, ph));
      }
    }
    __m256i is[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) is[r] = _mm256_madd_epi16(s16[r], ones);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 256 + 16 * h)));
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 288 + 16 * h)));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int64_t ab = static_cast<int64_t>(r0 + r) * kb + b;
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[ab])), acc[r]);
      acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[ab]), acc[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) store8(y + static_cast<int64_t>(r0 + r) * ldy + 8 * h, acc[r], add);
}

template <int R>
inline void q8_half(const uint8_t* w, int blocks, const Act& a, int r0, int h, float* y, int ldy, bool add,
                    const uint8_t* next) {
  const int kb = a.k / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + static_cast<int64_t>(b) * kQ8Bytes;
    prefetch_block<kQ8Bytes>(next, b);
    __m256i is[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) is[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * g + 32 * h));
      const __m256i mag = _mm256_abs_epi8(raw);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = a.q + static_cast<int64_t>(r0 + r) * a.k + b * kBlock + 4 * g;
        // |w| * (x with w's sign): maddubs takes its first operand unsigned, and the pair
        // sums stay within int16 (2 * 127 * 127).
        const __m256i px = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xq)), raw));
        is[r] = _mm256_add_epi32(is[r], _mm256_madd_epi16(px, ones));
      }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 512 + 16 * h)));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int64_t ab = static_cast<int64_t>(r0 + r) * kb + b;
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[ab])), acc[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) store8(y + static_cast<int64_t>(r0 + r) * ldy + 8 * h, acc[r], add);
}

template <int R>
inline void q4_tile(const uint8_t* w, int blocks, const Act& a, int r0, float* y, int ldy, bool add,
                    const uint8_t* next) {
  q4_half<R>(w, blocks, a, r0, 0, y, ldy, add, next);
  q4_half<R>(w, blocks, a, r0, 1, y, ldy, add, nullptr);
}

template <int R>
inline void q8_tile(const uint8_t* w, int blocks, const Act& a, int r0, float* y, int ldy, bool add,
                    const uint8_t* next) {
  q8_half<R>(w, blocks, a, r0, 0, y, ldy, add, next);
  q8_half<R>(w, blocks, a, r0, 1, y, ldy, add, nullptr);
}

#else
constexpr int kIsa = 0;
constexpr int kRowTile = 1;
constexpr int kSmallRows = 1;

template <int R>
inline void q4_tile(const uint8_t* w, int blocks, const Act& a, int r0, float* y, int ldy, bool add,
                    const uint8_t*) {
  q4_tile_scalar(w, blocks, a, r0, R, y, ldy, add);
}

template <int R>
inline void q8_tile(const uint8_t* w, int blocks, const Act& a, int r0, float* y, int ldy, bool add,
                    const uint8_t*) {
  q8_tile_scalar(w, blocks, a, r0, R, y, ldy, add);
}
#endif

// Rows [r0, r0 + rows) of one tile, in row tiles of kRowTile and one remainder instantiation.
template <int R, bool Q4>
inline void tile_rows(const uint8_t* w, int blocks, const Act& a, int r0, int rows, float* y, int ldy, bool add,
                      const uint8_t* next) {
  if constexpr (R == 0) {
    return;
  } else {
    if (rows == R) {
      if constexpr (Q4) q4_tile<R>(w, blocks, a, r0, y, ldy, add, next);
      else q8_tile<R>(w, blocks, a, r0, y, ldy, add, next);
    } else {
      tile_rows<R - 1, Q4>(w, blocks, a, r0, rows, y, ldy, add, next);
    }
  }
}

// y[:, tile columns] for tiles [t0, t1) of a packed [N, K] weight, all M rows of `a`.
template <bool Q4>
inline void gemm_tiles(const uint8_t* w, int k, const Act& a, int m, float* y, int ldy, bool add, int t0, int t1) {
  const int blocks = k / kBlock;
  const int64_t tile_bytes = static_cast<int64_t>(blocks) * (Q4 ? kQ4Bytes : kQ8Bytes);
  const bool pf = m > kSmallRows || prefetch_small().load(std::memory_order_relaxed);
#ifdef OSD_AMX
  const int amx_from = amx_min_rows().load(std::memory_order_relaxed);
  const bool amx = amx_from > 0 && m >= amx_from;
  if (amx) amx_configure();
#endif
  for (int t = t0; t < t1; ++t) {
    const uint8_t* wt = w + t * tile_bytes;
    // The last row tile asks for the next weight tile, so that the next first pass finds it
    // in cache instead of waiting on memory with the multipliers idle.
    const uint8_t* ahead = pf && t + 1 < t1 ? wt + tile_bytes : nullptr;
#ifdef OSD_AMX
    if (amx) {
      for (int r0 = 0; r0 < m; r0 += kAmxRows) {
        const int rows = m - r0 < kAmxRows ? m - r0 : kAmxRows;
        amx_rows<kAmxRows, Q4>(wt, blocks, a, r0, rows, y + t * kTile, ldy, add, r0 + kAmxRows >= m ? ahead : nullptr);
      }
      continue;
    }
#endif
    // As few passes as row tiles allow, their rows shared out evenly (9 rows: 5 + 4, not 8 + 1).
    const int passes = (m + kRowTile - 1) / kRowTile;
    for (int p = 0, r0 = 0; p < passes; ++p) {
      const int rows = (m - r0) / (passes - p);
      tile_rows<kRowTile, Q4>(wt, blocks, a, r0, rows, y + t * kTile, ldy, add, p + 1 == passes ? ahead : nullptr);
      r0 += rows;
    }
  }
}

}  // namespace osd
