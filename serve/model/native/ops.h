// The forward's small operations, written as plain loops in a fixed order (sums in 16 lanes,
// then a fixed tree), so that every instruction set gives the same bits and a row's result
// never depends on the other rows.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <immintrin.h>

namespace osd {

constexpr int kLanes = 16;
constexpr int kMaxAttendQueries = 16;  // queries of one KV head attended in one call

// max/min that compile to one instruction (std::fmax is a libm call where NaNs must be handled).
inline float fmax_(float a, float b) { return a > b ? a : b; }
inline float fmin_(float a, float b) { return a < b ? a : b; }

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch's conversion
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7F800000u) == 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | ((bits & 0xFFFF) ? 64 : 0));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// The operations fexp is made of, for one float (below) and for a vector of lanes (after it),
// so that one definition gives every path the same bits.
template <class V>
struct ExpOps;

template <>
struct ExpOps<float> {
  static float c(float v) { return v; }
  static float max(float a, float b) { return fmax_(a, b); }
  static float min(float a, float b) { return fmin_(a, b); }
  static float add(float a, float b) { return a + b; }
  static float mul(float a, float b) { return a * b; }
  static float fma(float a, float b, float c) { return std::fma(a, b, c); }
  static float round(float a) { return std::nearbyint(a); }
  static float pow2(float n) {  // 2^n for an integral n in [-126, 127]
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
  }
};

// e^x by range reduction to [-ln2/2, ln2/2] and a degree-6 polynomial (Cephes' expf
// coefficients), within 2 ulp; only + * fma and bit operations, so it vectorises identically.
template <class V>
inline V fexp_lanes(V x) {
  using O = ExpOps<V>;
  x = O::min(O::max(x, O::c(-87.0f)), O::c(88.0f));
  const V n = O::round(O::mul(x, O::c(1.44269504088896341f)));
  V r = O::fma(n, O::c(-0.693359375f), x);
  r = O::fma(n, O::c(2.12194440e-4f), r);
  V p = O::c(1.9875691500e-4f);
  p = O::fma(p, r, O::c(1.3981999507e-3f));
  p = O::fma(p, r, O::c(8.3334519073e-3f));
  p = O::fma(p, r, O::c(4.1665795894e-2f));
  p = O::fma(p, r, O::c(1.6666665459e-1f));
  p = O::fma(p, r, O::c(5.0000001201e-1f));
  p = O::add(O::fma(p, O::mul(r, r), r), O::c(1.0f));
  return O::mul(p, O::pow2(n));
}

inline float fexp(float x) { return fexp_lanes(x); }

inline float lane_sum(const float* acc) {  // a fixed tree over 16 lanes
  float t[8];
  for (int l = 0; l < 8; ++l) t[l] = acc[l] + acc[l + 8];
  for (int l = 0; l < 4; ++l) t[l] = t[l] + t[l + 4];
  return (t[0] + t[2]) + (t[1] + t[3]);
}

// y = x / rms(x) * w, n a multiple of 16.
inline void rms_norm(const float* x, const float* w, int n, float eps, float* y) {
  float acc[kLanes] = {};
  for (int i = 0; i < n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = std::fma(x[i + l], x[i + l], acc[l]);
  const float inv = 1.0f / std::sqrt(lane_sum(acc) / static_cast<float>(n) + eps);
  for (int i = 0; i < n; ++i) y[i] = (x[i] * inv) * w[i];
}

// Rotate-half RoPE of one head in place: x * cos + roll(x, hd/2) * sin, sin's first half negated.
inline void rope(float* x, const float* cos, const float* sin, int hd) {
  float rot[256];
  const int half = hd / 2;
  for (int i = 0; i < half; ++i) {
    rot[i] = x[i + half];
    rot[i + half] = x[i];
  }
  for (int i = 0; i < hd; ++i) x[i] = std::fma(rot[i], sin[i], x[i] * cos[i]);
}

// ExpOps on vectors: each lane rounds to nearest (the default mode nearbyint follows).
constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
#if defined(__AVX512F__)
template <>
struct ExpOps<__m512> {
  static __m512 c(float v) { return _mm512_set1_ps(v); }
  static __m512 max(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
  static __m512 min(__m512 a, __m512 b) { return _mm512_min_ps(a, b); }
  static __m512 add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
  static __m512 mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
  static __m512 fma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
  static __m512 round(__m512 a) { return _mm512_roundscale_ps(a, kNearest); }
  static __m512 pow2(__m512 n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
template <>
struct ExpOps<__m256> {
  static __m256 c(float v) { return _mm256_set1_ps(v); }
  static __m256 max(__m256 a, __m256 b) { return _mm256_max_ps(a, b); }
  static __m256 min(__m256 a, __m256 b) { return _mm256_min_ps(a, b); }
  static __m256 add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
  static __m256 mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
  static __m256 fma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
  static __m256 round(__m256 a) { return _mm256_round_ps(a, kNearest); }
  static __m256 pow2(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
};
#endif

// silu(g) * u over n values: gu holds g then u ([2n]).
inline void swiglu(const float* gu, int n, float* out) {
  int i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gu + i);
    const __m512 e = fexp_lanes(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN))));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)),
                                            _mm512_loadu_ps(gu + n + i)));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gu + i);
    const __m256 e = fexp_lanes(_mm256_xor_ps(g, _mm256_set1_ps(-0.f)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                            _mm256_loadu_ps(gu + n + i)));
  }
#endif
  for (; i < n; ++i) {
    const float g = gu[i];
    out[i] = (g / (1.0f + fexp(-g))) * gu[n + i];
  }
}

// q . k for one key: 16 lanes (lane l sums the products at i = l mod 16 in order of i),
// then lane_sum's tree. The intrinsic paths keep exactly that order.
#if defined(__AVX512F__)
inline __m512 bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline float dot_key(const float* q, const uint16_t* k, int hd) {
  __m512 acc = _mm512_setzero_ps();
  for (int i = 0; i < hd; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), bf16x16(k + i), acc);
  const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2)));
}

// out[0:W] = sum_j p[j] * v_j[0:W] as four partial sums over j = 0, 1, 2, 3 (mod 4), each in
// order of j, added as (A0 + A1) + (A2 + A3): four independent FMA chains instead of one.
inline void pv_chunk32(const float* p, const uint16_t* v, int64_t stride, int len, float* out) {
  __m512 a[4][2];
  for (int k = 0; k < 4; ++k) a[k][0] = a[k][1] = _mm512_setzero_ps();
  int j = 0;
  for (; j + 4 <= len; j += 4)
    for (int k = 0; k < 4; ++k) {
      const __m512 pj = _mm512_set1_ps(p[j + k]);
      a[k][0] = _mm512_fmadd_ps(pj, bf16x16(v + (j + k) * stride), a[k][0]);
      a[k][1] = _mm512_fmadd_ps(pj, bf16x16(v + (j + k) * stride + 16), a[k][1]);
    }
  for (int k = 0; j < len; ++j, ++k) {
    const __m512 pj = _mm512_set1_ps(p[j]);
    a[k][0] = _mm512_fmadd_ps(pj, bf16x16(v + j * stride), a[k][0]);
    a[k][1] = _mm512_fmadd_ps(pj, bf16x16(v + j * stride + 16), a[k][1]);
  }
  for (int h = 0; h < 2; ++h)
    _mm512_storeu_ps(out + 16 * h, _mm512_add_ps(_mm512_add_ps(a[0][h], a[1][h]), _mm512_add_ps(a[2][h], a[3][h])));
}

inline void pv_chunk16(const float* p, const uint16_t* v, int64_t stride, int len, float* out) {
  __m512 a[4];
  for (int k = 0; k < 4; ++k) a[k] = _mm512_setzero_ps();
  int j = 0;
  for (; j + 4 <= len; j += 4)
    for (int k = 0; k < 4; ++k) a[k] = _mm512_fmadd_ps(_mm512_set1_ps(p[j + k]), bf16x16(v + (j + k) * stride), a[k]);
  for (int k = 0; j < len; ++j, ++k) a[k] = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), bf16x16(v + j * stride), a[k]);
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

inline float dot_key(const float* q, const uint16_t* k, int hd) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  // lanes 0-7 and 8-15
  for (int i = 0; i < hd; i += 16) {
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), bf16x8(k + i), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), bf16x8(k + i + 8), hi);
  }
  const __m256 t8 = _mm256_add_ps(lo, hi);
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2)));
}

inline void pv_chunk16(const float* p, const uint16_t* v, int64_t stride, int len, float* out) {
  __m256 a[4][2];
  for (int k = 0; k < 4; ++k) a[k][0] = a[k][1] = _mm256_setzero_ps();
  int j = 0;
  for (; j + 4 <= len; j += 4)
    for (int k = 0; k < 4; ++k) {
      const __m256 pj = _mm256_set1_ps(p[j + k]);
      a[k][0] = _mm256_fmadd_ps(pj, bf16x8(v + (j + k) * stride), a[k][0]);
      a[k][1] = _mm256_fmadd_ps(pj, bf16x8(v + (j + k) * stride + 8), a[k][1]);
    }
  for (int k = 0; j < len; ++j, ++k) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    a[k][0] = _mm256_fmadd_ps(pj, bf16x8(v + j * stride), a[k][0]);
    a[k][1] = _mm256_fmadd_ps(pj, bf16x8(v + j * stride + 8), a[k][1]);
  }
  for (int h = 0; h < 2; ++h)
    _mm256_storeu_ps(out + 8 * h, _mm256_add_ps(_mm256_add_ps(a[0][h], a[1][h]), _mm256_add_ps(a[2][h], a[3][h])));
}

inline void pv_chunk32(const float* p, const uint16_t* v, int64_t stride, int len, float* out) {
  pv_chunk16(p, v, stride, len, out);  // 16 registers hold 16 columns' four partial sums
  pv_chunk16(p, v + 16, stride, len, out + 16);
}
#else
inline float dot_key(const float* q, const uint16_t* k, int hd) {
  float acc[kLanes] = {};
  for (int i = 0; i < hd; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = std::fma(q[i + l], bf16_to_float(k[i + l]), acc[l]);
  return lane_sum(acc);
}

template <int W>
inline void pv_chunk(const float* p, const uint16_t* v, int64_t stride, int len, float* out) {
  float a[4][W] = {};
  for (int j = 0; j < len; ++j)
    for (int i = 0; i < W; ++i) a[j & 3][i] = std::fma(p[j], bf16_to_float(v[j * stride + i]), a[j & 3][i]);
  for (int i = 0; i < W; ++i) out[i] = (a[0][i] + a[1][i]) + (a[2][i] + a[3][i]);
}

inline void pv_chunk32(const float* p, const uint16_t* v, int64_t stride, int len, float* out) {
  pv_chunk<32>(p, v, stride, len, out);
}

inline void pv_chunk16(const float* p, const uint16_t* v, int64_t stride, int len, float* out) {
  pv_chunk<16>(p, v, stride, len, out);
}
#endif

// softmax(scores * 1) in place over [0, len): exp(s - max) / sum, the max and the sum in 16
// lanes (a max is exact in any order, and lanes let it vectorise: one running max is a chain).
inline void softmax_row(float* scores, int len) {
  alignas(64) float lane_max[kLanes];
  for (int l = 0; l < kLanes; ++l) lane_max[l] = -INFINITY;
  int j = 0;
#if defined(__AVX512F__)
  {
    __m512 m = _mm512_load_ps(lane_max);
    for (; j + kLanes <= len; j += kLanes) m = _mm512_max_ps(m, _mm512_loadu_ps(scores + j));
    _mm512_store_ps(lane_max, m);
  }
#elif defined(__AVX2__)
  {
    __m256 lo = _mm256_load_ps(lane_max), hi = _mm256_load_ps(lane_max + 8);
    for (; j + kLanes <= len; j += kLanes) {
      lo = _mm256_max_ps(lo, _mm256_loadu_ps(scores + j));
      hi = _mm256_max_ps(hi, _mm256_loadu_ps(scores + j + 8));
    }
    _mm256_store_ps(lane_max, lo);
    _mm256_store_ps(lane_max + 8, hi);
  }
#endif
  for (; j + kLanes <= len; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lane_max[l] = fmax_(lane_max[l], scores[j + l]);
  for (int l = 0; j < len; ++j, ++l) lane_max[l] = fmax_(lane_max[l], scores[j]);
  float mx = -INFINITY;
  for (int l = 0; l < kLanes; ++l) mx = fmax_(mx, lane_max[l]);
  alignas(64) float sum[kLanes] = {};
  j = 0;
#if defined(__AVX512F__)
  {
    const __m512 m = _mm512_set1_ps(mx);
    __m512 acc = _mm512_setzero_ps();
    for (; j + kLanes <= len; j += kLanes) {
      const __m512 e = fexp_lanes(_mm512_sub_ps(_mm512_loadu_ps(scores + j), m));
      _mm512_storeu_ps(scores + j, e);
      acc = _mm512_add_ps(acc, e);
    }
    _mm512_store_ps(sum, acc);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  {
    const __m256 m = _mm256_set1_ps(mx);
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (; j + kLanes <= len; j += kLanes) {
      const __m256 el = fexp_lanes(_mm256_sub_ps(_mm256_loadu_ps(scores + j), m));
      const __m256 eh = fexp_lanes(_mm256_sub_ps(_mm256_loadu_ps(scores + j + 8), m));
      _mm256_storeu_ps(scores + j, el);
      _mm256_storeu_ps(scores + j + 8, eh);
      lo = _mm256_add_ps(lo, el);
      hi = _mm256_add_ps(hi, eh);
    }
    _mm256_store_ps(sum, lo);
    _mm256_store_ps(sum + 8, hi);
  }
#endif
  for (; j + kLanes <= len; j += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      scores[j + l] = fexp(scores[j + l] - mx);
      sum[l] += scores[j + l];
    }
  for (int l = 0; j < len; ++j, ++l) {
    scores[j] = fexp(scores[j] - mx);
    sum[l] += scores[j];
  }
  const float inv = 1.0f / lane_sum(sum);
  for (int jj = 0; jj < len; ++jj) scores[jj] *= inv;
}

}  // namespace osd
