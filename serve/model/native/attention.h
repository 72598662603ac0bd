// Attention of one KV head's queries over its cache (bf16 keys and values).
//
// The arithmetic is fixed per query, whatever else shares the call: q . k_j in 16 lanes
// (lane l sums the products at i = l mod 16 in order of i, then lane_sum's tree), times the
// scale; softmax_row; then each output column sums p_j * v_j[c] in four chains over
// j = 0, 1, 2, 3 (mod 4), each in order of j, added as (A0 + A1) + (A2 + A3). ops.h's
// dot_key and pv_chunk are that arithmetic for one query at a time; the AVX-512 path below
// computes the same bits for a tile of queries, sharing each key's and value's conversion
// to float among them and reducing 16 keys' lanes at once instead of one key at a time.
#pragma once

#include <cstdint>

#include <immintrin.h>

#include "ops.h"

namespace osd {

#if defined(__AVX512F__)
constexpr int kPvQueries = 4;  // queries sharing each converted value row: 16 accumulators

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

// out[i][c0, c0 + 16) for up to kPvQueries queries over keys [0, len): p rows zero past each
// query's own length, so a longer neighbour's keys add exact zeros.
template <int Q>
inline void pv_tile(const float* const* p, const uint16_t* v, int64_t stride, int len, float* const* out, int c0) {
  __m512 a[Q][4];
#pragma GCC unroll 8
  for (int i = 0; i < Q; ++i)
    for (int k = 0; k < 4; ++k) a[i][k] = _mm512_setzero_ps();
  int j = 0;
  for (; j + 4 <= len; j += 4)
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m512 vj = bf16x16(v + (j + k) * stride + c0);
#pragma GCC unroll 8
      for (int i = 0; i < Q; ++i) a[i][k] = _mm512_fmadd_ps(_mm512_set1_ps(p[i][j + k]), vj, a[i][k]);
    }
  for (int k = 0; j < len; ++j, ++k) {
    const __m512 vj = bf16x16(v + j * stride + c0);
#pragma GCC unroll 8
    for (int i = 0; i < Q; ++i) a[i][k] = _mm512_fmadd_ps(_mm512_set1_ps(p[i][j]), vj, a[i][k]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < Q; ++i)
    _mm512_storeu_ps(out[i] + c0, _mm512_add_ps(_mm512_add_ps(a[i][0], a[i][1]), _mm512_add_ps(a[i][2], a[i][3])));
}

inline void pv_tiles(const float* const* p, int n, const uint16_t* v, int64_t stride, int len, int hd,
                     float* const* out) {
  for (int i0 = 0; i0 < n; i0 += kPvQueries) {
    const int m = n - i0 < kPvQueries ? n - i0 : kPvQueries;
    for (int c = 0; c < hd; c += 16) {
      if (m == 4) pv_tile<4>(p + i0, v, stride, len, out + i0, c);
      else if (m == 3) pv_tile<3>(p + i0, v, stride, len, out + i0, c);
      else if (m == 2) pv_tile<2>(p + i0, v, stride, len, out + i0, c);
      else pv_tile<1>(p + i0, v, stride, len, out + i0, c);
    }
  }
}

// Several query rows against one cache head's keys/values (bf16, position stride `stride`):
// query i attends over positions [0, len[i]) into out[i] [hd], hd a multiple of 16 and at
// most 256. `scores` holds n * max(len) floats.
inline void attend_rows(const float* const* q, const int* len, int n, const uint16_t* k, const uint16_t* v,
                        int64_t stride, int hd, float scale, float* scores, float* const* out) {
  int max_len = 0;
  for (int i = 0; i < n; ++i) max_len = len[i] > max_len ? len[i] : max_len;
  alignas(64) float kf[16 * 256];
  for (int j0 = 0; j0 < max_len; j0 += 16) {
    const int cnt = max_len - j0 < 16 ? max_len - j0 : 16;
    for (int j = 0; j < 16; ++j)
      for (int c = 0; c < hd; c += 16)
        _mm512_store_ps(kf + j * hd + c, j < cnt ? bf16x16(k + (j0 + j) * stride + c) : _mm512_setzero_ps());
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
