// Attention of one KV head's queries over its cache (bf16 keys and values).
//
// The arithmetic is fixed per query, whatever else shares the call: q . k_j in 16 lanes
// (lane l sums the products at i = l mod 16 in order of i, then lane_sum's tree), times the
// scale; softmax_row; then each output column sums p_j * v_j[c] in four chains over
// j = 0, 1, 2, 3 (mod 4), each in order of j, added as (A0 + A1) + (A2 + A3). ops.h's
// dot_key and pv_chunk are that arithmetic for one query at a time; the AVX-512 path below
// computes the same bits for a tile of queries, sharing each key's and value's conversion
// to float among them and reducing 16 keys' lanes at once instead of one key at a time; the
// AVX2 path does the same in blocks of 8 keys, reducing 4 at a time.
#pragma once

#include <cstdint>

#include <immintrin.h>

#include "ops.h"

namespace osd {

#if defined(__AVX512F__)
constexpr int kKeyBlock = 16;  // keys converted and reduced together
constexpr int kPvQueries = 4;  // queries sharing each converted value row: 16 accumulators
using Vec = __m512;            // kVec columns of a value row
constexpr int kVec = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vbf16(const uint16_t* p) { return bf16x16(p); }
inline void vstore(float* p, Vec a) { _mm512_storeu_ps(p, a); }

// s[j] = lane_sum(a[j]) for 16 vectors: the same tree, with four levels of pairwise shuffles
// and adds that each serve several keys at once.
inline __m512 lane_sums16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int k = 0; k < 8; ++k)  // t8[l] = a[l] + a[l + 8]: keys k and k + 8 in one register
    b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[k], a[k + 8], 0x44), _mm512_shuffle_f32x4(a[k], a[k + 8], 0xEE));
  for (int k = 0; k < 4; ++k)  // t4[l] = t8[l] + t8[l + 4]: keys k, k + 8, k + 4, k + 12
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[k], b[k + 4], 0x88), _mm512_shuffle_f32x4(b[k], b[k + 4], 0xDD));
  for (int k = 0; k < 2; ++k)  // t2[0] = t4[0] + t4[2], t2[1] = t4[1] + t4[3]
    d[k] = _mm512_add_ps(_mm512_shuffle_ps(c[k], c[k + 2], 0x44), _mm512_shuffle_ps(c[k], c[k + 2], 0xEE));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  // e holds keys 0 2 1 3, 8 10 9 11, 4 6 5 7, 12 14 13 15
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(order, e);
}

// Scores of n queries against keys [j0, j0 + cnt), cnt <= 16: kf holds those keys as float
// [16, hd] (rows past cnt zero); scores[i * ld + j] for j < cnt.
inline void qk_block(const float* const* q, int n, const float* kf, int hd, int cnt, float scale, float* scores,
                     int ld) {
  const __mmask16 keep = static_cast<__mmask16>((1u << cnt) - 1u);
  for (int i = 0; i < n; ++i) {
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
    for (int c = 0; c < hd; c += 16) {
      const __m512 qc = _mm512_loadu_ps(q[i] + c);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(kf + j * hd + c), acc[j]);
    }
    _mm512_mask_storeu_ps(scores + i * ld, keep, _mm512_mul_ps(lane_sums16(acc), _mm512_set1_ps(scale)));
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kKeyBlock = 8;
constexpr int kPvQueries = 3;  // 12 accumulators
using Vec = __m256;
constexpr int kVec = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vbf16(const uint16_t* p) { return bf16x8(p); }
inline void vstore(float* p, Vec a) { _mm256_storeu_ps(p, a); }

// lane_sum of four keys' 16 lanes (lo: lanes 0-7, hi: lanes 8-15 of each), as [k0 k1 k2 k3]:
// dot_key's tree, each level's adds serving two or four keys at once.
inline __m128 lane_sums4(const __m256* lo, const __m256* hi) {
  __m256 t8[4];
  for (int k = 0; k < 4; ++k) t8[k] = _mm256_add_ps(lo[k], hi[k]);  // t8[l] = a[l] + a[l + 8]
  // t4[l] = t8[l] + t8[l + 4]: keys 0 | 1 and 2 | 3 in the two 128-bit halves
  const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(t8[0], t8[1], 0x20), _mm256_permute2f128_ps(t8[0], t8[1], 0x31));
  const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(t8[2], t8[3], 0x20), _mm256_permute2f128_ps(t8[2], t8[3], 0x31));
  // t2 = (t4[0] + t4[2], t4[1] + t4[3]): halves hold [k0 k0 k2 k2] and [k1 k1 k3 k3]
  const __m256 t2 = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));
  // t2[0] + t2[1]: halves [k0 k2 k0 k2] and [k1 k3 k1 k3]
  const __m256 e = _mm256_add_ps(_mm256_shuffle_ps(t2, t2, 0x88), _mm256_shuffle_ps(t2, t2, 0xDD));
  return _mm256_castps256_ps128(_mm256_permutevar8x32_ps(e, _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5)));
}

// As the AVX-512 qk_block, for cnt <= 8 keys.
inline void qk_block(const float* const* q, int n, const float* kf, int hd, int cnt, float scale, float* scores,
                     int ld) {
  const __m128 sc = _mm_set1_ps(scale);
  for (int i = 0; i < n; ++i) {
    alignas(32) float out[8];
    for (int j0 = 0; j0 < 8; j0 += 4) {
      __m256 lo[4], hi[4];
      for (int j = 0; j < 4; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
      for (int c = 0; c < hd; c += 16) {
        const __m256 ql = _mm256_loadu_ps(q[i] + c), qh = _mm256_loadu_ps(q[i] + c + 8);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          lo[j] = _mm256_fmadd_ps(ql, _mm256_loadu_ps(kf + (j0 + j) * hd + c), lo[j]);
          hi[j] = _mm256_fmadd_ps(qh, _mm256_loadu_ps(kf + (j0 + j) * hd + c + 8), hi[j]);
        }
      }
      _mm_store_ps(out + j0, _mm_mul_ps(lane_sums4(lo, hi), sc));
    }
    for (int j = 0; j < cnt; ++j) scores[i * ld + j] = out[j];
  }
}

#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
template <_mm_hint Hint>
inline void prefetch_row(const uint16_t* row, int bytes) {
  for (int b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + b, Hint);
}

// out[i][c0, c0 + kVec) for Q <= kPvQueries queries over keys [0, len): p rows zero past each
// query's own length, so a longer neighbour's keys add exact zeros.
template <int Q>
inline void pv_tile(const float* const* p, const uint16_t* v, int64_t stride, int len, float* const* out, int c0) {
  Vec a[Q][4];
#pragma GCC unroll 8
  for (int i = 0; i < Q; ++i)
    for (int k = 0; k < 4; ++k) a[i][k] = vzero();
  int j = 0;
  for (; j + 4 <= len; j += 4)
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const Vec vj = vbf16(v + (j + k) * stride + c0);
#pragma GCC unroll 8
      for (int i = 0; i < Q; ++i) a[i][k] = vfma(vset1(p[i][j + k]), vj, a[i][k]);
    }
  for (int k = 0; j < len; ++j, ++k) {
    const Vec vj = vbf16(v + j * stride + c0);
#pragma GCC unroll 8
    for (int i = 0; i < Q; ++i) a[i][k] = vfma(vset1(p[i][j]), vj, a[i][k]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < Q; ++i) vstore(out[i] + c0, vadd(vadd(a[i][0], a[i][1]), vadd(a[i][2], a[i][3])));
}

// m (1..Q) queries' columns [c0, c0 + kVec): one instantiation per count.
template <int Q>
inline void pv_rest(int m, const float* const* p, const uint16_t* v, int64_t stride, int len, float* const* out,
                    int c0) {
  if constexpr (Q > 0) {
    if (m == Q) pv_tile<Q>(p, v, stride, len, out, c0);
    else pv_rest<Q - 1>(m, p, v, stride, len, out, c0);
  }
}

inline void pv_tiles(const float* const* p, int n, const uint16_t* v, int64_t stride, int len, int hd,
                     float* const* out) {
  for (int i0 = 0; i0 < n; i0 += kPvQueries) {
    const int m = n - i0 < kPvQueries ? n - i0 : kPvQueries;
    for (int c = 0; c < hd; c += kVec) pv_rest<kPvQueries>(m, p + i0, v, stride, len, out + i0, c);
  }
}

// Several query rows against one cache head's keys/values (bf16, position stride `stride`):
// query i attends over positions [0, len[i]) into out[i] [hd], hd a multiple of 16 and at
// most 256. `scores` holds n * max(len) floats.
inline void attend_rows(const float* const* q, const int* len, int n, const uint16_t* k, const uint16_t* v,
                        int64_t stride, int hd, float scale, float* scores, float* const* out) {
  int max_len = 0;
  for (int i = 0; i < n; ++i) max_len = len[i] > max_len ? len[i] : max_len;
  alignas(64) float kf[kKeyBlock * 256];
  // A head's keys and values are a few tens of KB, too short a stream for the hardware
  // prefetchers to reach speed: the keys are asked for two blocks ahead (into L1), and the
  // values, which the products read after the softmax, as the keys go by (into L2).
  const int row_bytes = hd * 2;
  for (int j = 0; j < 2 * kKeyBlock && j < max_len; ++j) prefetch_row<_MM_HINT_T0>(k + j * stride, row_bytes);
  for (int j0 = 0; j0 < max_len; j0 += kKeyBlock) {
    const int cnt = max_len - j0 < kKeyBlock ? max_len - j0 : kKeyBlock;
    for (int j = j0; j < j0 + cnt; ++j) {
      if (j + 2 * kKeyBlock < max_len) prefetch_row<_MM_HINT_T0>(k + (j + 2 * kKeyBlock) * stride, row_bytes);
      prefetch_row<_MM_HINT_T1>(v + j * stride, row_bytes);
    }
    for (int j = 0; j < kKeyBlock; ++j)
      for (int c = 0; c < hd; c += kVec) vstore(kf + j * hd + c, j < cnt ? vbf16(k + (j0 + j) * stride + c) : vzero());
    qk_block(q, n, kf, hd, cnt, scale, scores + j0, max_len);
  }
  const float* p[kMaxAttendQueries];
  for (int i = 0; i < n; ++i) {
    float* row = scores + i * max_len;
    softmax_row(row, len[i]);
    for (int j = len[i]; j < max_len; ++j) row[j] = 0.f;
    p[i] = row;
  }
  pv_tiles(p, n, v, stride, max_len, hd, out);
}
#else
// One query at a time: ops.h's dot_key and pv_chunk, keys outermost so that each key comes
// from memory once for all the queries.
inline void attend_rows(const float* const* q, const int* len, int n, const uint16_t* k, const uint16_t* v,
                        int64_t stride, int hd, float scale, float* scores, float* const* out) {
  int max_len = 0;
  for (int i = 0; i < n; ++i) max_len = len[i] > max_len ? len[i] : max_len;
  for (int j = 0; j < max_len; ++j) {
    const uint16_t* kj = k + j * stride;
    for (int i = 0; i < n; ++i)
      if (j < len[i]) scores[i * max_len + j] = dot_key(q[i], kj, hd) * scale;
  }
  for (int i = 0; i < n; ++i) {
    float* p = scores + i * max_len;
    softmax_row(p, len[i]);
    int c = 0;
    for (; c + 32 <= hd; c += 32) pv_chunk32(p, v + c, stride, len[i], out[i] + c);
    if (c < hd) pv_chunk16(p, v + c, stride, len[i], out[i] + c);
  }
}
#endif

}  // namespace osd
