// What a step reads off each logit row besides sampling: the argmax (greedy verify) and the k
// largest entries with their log-probabilities (the records' top-k), in two passes over the
// row: the max and its index with the ISA's compares (Scan), then the exponential sum in the
// 16-lane loop the compiler vectorises (ops.h fexp) beside the top-k. Timings: docs/benchmarks.md.
#pragma once

#include <cmath>
#include <cstdint>

#include <immintrin.h>

#include "ops.h"

namespace osd {

constexpr int kMaxTopK = 64;
constexpr int kThreadedLogitRows = 16;  // fewer rows: read on the calling thread alone

#if defined(__AVX512F__)
constexpr int kScan = 16;
struct Scan {  // kScan floats at a time: max, NaN lanes, lanes above a value
  __m512 mx = _mm512_set1_ps(-INFINITY);
  unsigned nan = 0;
  void take(const float* p) {
    const __m512 v = _mm512_loadu_ps(p);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, v);
  }
  float max() const { return _mm512_reduce_max_ps(mx); }
  static unsigned above(const float* p, float t) {
    return _mm512_cmp_ps_mask(_mm512_loadu_ps(p), _mm512_set1_ps(t), _CMP_GT_OQ);
  }
  static unsigned equal(const float* p, float t) {
    return _mm512_cmp_ps_mask(_mm512_loadu_ps(p), _mm512_set1_ps(t), _CMP_EQ_OQ);
  }
};
#elif defined(__AVX2__)
constexpr int kScan = 8;
struct Scan {
  __m256 mx = _mm256_set1_ps(-INFINITY);
  unsigned nan = 0;
  void take(const float* p) {
    const __m256 v = _mm256_loadu_ps(p);
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, v);
  }
  float max() const {
    float l[8];
    _mm256_storeu_ps(l, mx);
    float m = l[0];
    for (int i = 1; i < 8; ++i) m = fmax_(m, l[i]);
    return m;
  }
  static unsigned above(const float* p, float t) {
    return _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p), _mm256_set1_ps(t), _CMP_GT_OQ));
  }
  static unsigned equal(const float* p, float t) {
    return _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p), _mm256_set1_ps(t), _CMP_EQ_OQ));
  }
};
#else
constexpr int kScan = 1;
struct Scan {
  float mx = -INFINITY;
  unsigned nan = 0;
  void take(const float* p) { nan |= *p != *p, mx = fmax_(mx, *p); }
  float max() const { return mx; }
  static unsigned above(const float* p, float t) { return *p > t; }
  static unsigned equal(const float* p, float t) { return *p == t; }
};
#endif

// Row x [v]: *amax the first index of the largest value; ids/lps the k largest in descending
// order (equal values: the lower id first), as log-probabilities under softmax(x). Returns
// false, writing nothing, where the row holds a NaN or +inf (the caller's PyTorch path has
// the rules for those).
inline bool logit_row(const float* x, int v, int k, int64_t* amax, int64_t* ids, float* lps) {
  const int body = v - v % kScan;
  Scan scan;
  for (int i = 0; i < body; i += kScan) scan.take(x + i);
  float m = scan.max();
  bool bad = scan.nan != 0;
  for (int i = body; i < v; ++i) m = fmax_(m, x[i]), bad |= x[i] != x[i];
  if (bad || m == INFINITY) return false;
  int arg = 0;
  for (int i = 0;; i += kScan) {
    if (i >= body) {
      for (arg = body; x[arg] != m; ++arg) {}
      break;
    }
    if (const unsigned hit = Scan::equal(x + i, m)) {
      arg = i + __builtin_ctz(hit);
      break;
    }
  }
  *amax = arg;
  if (k == 0) return true;
  // One more pass: the sum of e^(x - m) (the max's own term is 1, so it is never 0), and the k
  // largest in a sorted buffer; past the first k entries, a chunk is looked at entry by entry
  // only where it holds one above the buffer's last.
  float acc[kLanes] = {};
  float val[kMaxTopK];
  int64_t idx[kMaxTopK];
  int n = 0;
  auto offer = [&](float xv, int64_t i) {
    if (n == k && !(xv > val[k - 1])) return;
    int p = n < k ? n++ : k - 1;
    while (p > 0 && xv > val[p - 1]) val[p] = val[p - 1], idx[p] = idx[p - 1], --p;
    val[p] = xv, idx[p] = i;
  };
  const bool finite = m != -INFINITY;  // all -inf: every term is e^(-inf - -inf), left out
  const int body16 = v - v % kLanes;
  for (int i = 0; i < body16; i += kLanes) {
    if (finite)
      for (int l = 0; l < kLanes; ++l) acc[l] += fexp(x[i + l] - m);
    if (n < k) {
      for (int l = 0; l < kLanes; ++l) offer(x[i + l], i + l);
      continue;
    }
    for (int j = i; j < i + kLanes; j += kScan)
      for (unsigned hit = Scan::above(x + j, val[k - 1]); hit; hit &= hit - 1)
        offer(x[j + __builtin_ctz(hit)], j + __builtin_ctz(hit));
  }
  for (int i = body16; i < v; ++i) {
    if (finite) acc[0] += fexp(x[i] - m);
    offer(x[i], i);
  }
  const float lse = finite ? m + std::log(lane_sum(acc)) : m;
  for (int j = 0; j < n; ++j) ids[j] = idx[j], lps[j] = val[j] - lse;
  return true;
}

}  // namespace osd
