// The Llama forward over packed int4 weights: every layer of a step in one call, no Python
// between them. Rows may belong to several sequences (a batched step): each row writes its
// K/V at its own position of its own cache and attends over that cache's positions [0, pos].
// A head draft's one layer runs on the same code over Q8 weights (osd_head_forward).
// Built once per instruction set (serve/model/native_build.py); the Python side is
// serve/model/native_runner.py, and serve/spec_decode/head/native.py for a head.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "attention.h"
#include "gemm.h"
#include "logits.h"
#include "ops.h"
#include "pool.h"

extern "C" {

struct OsdLayer {
  const uint8_t* wqkv;  // Q4 [(H + 2 KV) * hd, D]
  const uint8_t* wo;    // Q4 [D, H * hd]
  const uint8_t* wgu;   // Q4 [2 I, D]: gate rows, then up rows
  const uint8_t* wd;    // Q4 [D, I]
  const float* ln1;     // [D]
  const float* ln2;     // [D]
  const float* bqkv;    // [(H + 2 KV) * hd] or null (Qwen2; Llama with attention_bias)
  const float* bo;      // [D] or null
  const float* q_norm;  // [hd] or null (Qwen3: RMSNorm of each q and k head before RoPE)
  const float* k_norm;  // [hd] or null
};

struct OsdModel {
  int32_t n_layers, hidden, n_heads, n_kv, head_dim, inter, vocab, max_pos;  // vocab: the head's rows (16s)
  int32_t n_tokens;  // the embedding's rows
  float eps, attn_scale;
  const OsdLayer* layers;
  const uint16_t* embed;  // bf16 [vocab, D]
  const float* norm;      // [D]
  const uint8_t* head;    // Q8 [vocab, D], rows past n_tokens zero
  const float* cos;       // [max_pos, hd]
  const float* sin;       // [max_pos, hd], first half negated
};

struct OsdSeq {  // one sequence's cache: bf16 elements, strides in elements
  uint16_t* k;
  uint16_t* v;
  int64_t s_layer, s_head, s_pos;
};

struct OsdBatch {
  int32_t n_rows;
  const int64_t* tokens;  // [n_rows]
  const int32_t* pos;     // [n_rows] cache position each row is written at
  const int32_t* seq;     // [n_rows] index into seqs
  const OsdSeq* seqs;
  int32_t n_logit_rows;   // rows whose logits are wanted
  const int32_t* logit_rows;
  float* logits;          // [n_logit_rows, vocab]
  int32_t n_feat_layers;  // layers whose outputs are wanted (features)
  const int32_t* feat_layers;
  uint16_t* feats;        // bf16 [n_rows, n_feat_layers * D]
  int32_t n_threads;
};

// What a head draft (serve/spec_decode/head/native.py) adds to a one-layer model whose layer
// weights are Q8: each row's input is in_proj of [rms(embed[token]) norm_e, rms(g) norm_g].
struct OsdHeadIn {
  const uint8_t* in_proj;  // Q8 [D, 2 D]
  const float* norm_e;     // [D]
  const float* norm_g;     // [D]
  const float* g;          // [n_rows, D]: the target's fused features, or the head's previous state
  float* states;           // [n_rows, D]: the layer's outputs (before the final norm)
};

}  // extern "C"

namespace osd {
namespace {

struct Quantized {  // activations of M rows, quantized for the next GEMM
  std::vector<int8_t> q;
  std::vector<float> d, s;
  void resize(int m, int k) {
    q.resize(static_cast<size_t>(m + kRowSlack) * k);  // an AMX tile reads 16 rows from any row
    d.resize(static_cast<size_t>(m) * k / kBlock);
    s.resize(static_cast<size_t>(m) * k / kBlock);
  }
  Act act(int k) const { return Act{q.data(), d.data(), s.data(), k}; }
};

struct Work {  // per-call buffers, kept per calling thread so a step allocates nothing
  std::vector<float> x, tmp, qkv, att, gu, act, scores;
  std::vector<int> items;  // attention work items, 4 ints each
  Quantized qa;
};

Work& work() {
  thread_local Work w;
  return w;
}

// One forward at a time in a process: the pool runs one phase at a time, and two callers
// (engines on two Python threads) would open phases over each other.
std::mutex& forward_lock() {
  static std::mutex* m = new std::mutex();
  return *m;
}

// A library call begins: tile configurations are loaded again (amx.h amx_epoch).
void new_call() {
#ifdef OSD_AMX
  amx_epoch().fetch_add(1, std::memory_order_relaxed);
#endif
}

template <class F>
void for_rows(int rows, int threads, F&& fn) {  // small elementwise work: split only when it pays
  if (rows < 4 || threads <= 1) {
    for (int r = 0; r < rows; ++r) fn(r);
    return;
  }
  Pool::get().run(threads, rows, [&](int r, int) { fn(r); });
}

template <bool Q4>
void gemm(const uint8_t* w, int n, int k, const Act& a, int m, float* y, int ldy, bool add, int threads) {
  // Items of a few tiles each: eight a thread, so a thread off its core leaves little behind.
  const int tiles = n / kTile;
  const int items = std::min(tiles, std::max(1, threads) * 8);
  Pool::get().run(threads, items, [&](int i, int) {
    int b, e;
    split(tiles, i, items, &b, &e);
    gemm_tiles<Q4>(w, k, a, m, y, ldy, add, b, e);
  });
}

void quantize_into(const float* x, int r, int k, Quantized& qa) {  // x: row r's k inputs
  const int kb = k / kBlock;
  quantize_row(x, k, qa.q.data() + static_cast<int64_t>(r) * k, qa.d.data() + static_cast<int64_t>(r) * kb,
               qa.s.data() + static_cast<int64_t>(r) * kb);
}

// Row r = make(r) (a pointer to its k values), quantized by the same thread that made it, so
// that the row does not cross to another core's cache in between.
template <class Make>
void make_quantize(int m, int k, Quantized& qa, int threads, Make&& make) {
  qa.resize(m, k);
  for_rows(m, threads, [&](int r) { quantize_into(make(r), r, k, qa); });
}

void quantize_rows(const float* x, int m, int k, int ldx, Quantized& qa, int threads) {
  make_quantize(m, k, qa, threads, [&](int r) { return x + static_cast<int64_t>(r) * ldx; });
}

void norm_quantize(const float* x, const float* w, int m, int d, float eps, Work& wk, int threads) {
  wk.tmp.resize(static_cast<size_t>(m) * d);
  make_quantize(m, d, wk.qa, threads, [&](int r) {
    float* out = wk.tmp.data() + static_cast<int64_t>(r) * d;
    rms_norm(x + static_cast<int64_t>(r) * d, w, d, eps, out);
    return out;
  });
}

// A family's additions to q|k|v before RoPE: biases, then per-head norms of q and k.
void qkv_extras(const OsdModel& md, const OsdLayer& ly, float* row) {
  const int hd = md.head_dim, nh = md.n_heads, nkv = md.n_kv;
  if (ly.bqkv)
    for (int i = 0; i < (nh + 2 * nkv) * hd; ++i) row[i] += ly.bqkv[i];
  if (ly.q_norm)
    for (int h = 0; h < nh + nkv; ++h) rms_norm(row + h * hd, h < nh ? ly.q_norm : ly.k_norm, hd, md.eps, row + h * hd);
}

// RoPE on q and k, K/V written into each row's cache, then attention for every (row, head).
void attention(const OsdModel& md, const OsdBatch& bt, int layer, Work& wk, int threads) {
  const int m = bt.n_rows, hd = md.head_dim, nh = md.n_heads, nkv = md.n_kv;
  const int width = (nh + 2 * nkv) * hd;
  for_rows(m, threads, [&](int r) {
    float* row = wk.qkv.data() + static_cast<int64_t>(r) * width;
    const int64_t p = bt.pos[r];
    const float* c = md.cos + p * hd;
    const float* s = md.sin + p * hd;
    qkv_extras(md, md.layers[layer], row);
    for (int h = 0; h < nh + nkv; ++h) rope(row + h * hd, c, s, hd);
    const OsdSeq& sq = bt.seqs[bt.seq[r]];
    for (int h = 0; h < nkv; ++h) {
      const int64_t off = layer * sq.s_layer + h * sq.s_head + p * sq.s_pos;
      const float* kr = row + (nh + h) * hd;
      const float* vr = row + (nh + nkv + h) * hd;
      for (int i = 0; i < hd; ++i) {
        sq.k[off + i] = float_to_bf16(kr[i]);
        sq.v[off + i] = float_to_bf16(vr[i]);
      }
    }
  });
  // Work items: (sequence, KV head, a chunk of its queries); a sequence's rows are adjacent.
  const int group = nh / nkv;
  std::vector<int>& items = wk.items;
  items.clear();
  int max_len = 0;
  for (int r = 0; r < m; ++r) max_len = std::max(max_len, bt.pos[r] + 1);
  const int workers = std::max(threads, 1);
  // Each chunk of a KV head's queries reads its keys and values again: one row's group of
  // queries is never split.
  const int fine = std::clamp((m * nh + 4 * workers - 1) / (4 * workers), 1, kMaxAttendQueries);
  const int chunk = std::max(fine, std::min(group, kMaxAttendQueries));
  for (int r0 = 0; r0 < m;) {
    int r1 = r0 + 1;
    while (r1 < m && bt.seq[r1] == bt.seq[r0]) ++r1;
    const int nq = (r1 - r0) * group;
    for (int g = 0; g < nkv; ++g)
      for (int q0 = 0; q0 < nq; q0 += chunk) items.insert(items.end(), {r0, g, q0, std::min(nq, q0 + chunk)});
    r0 = r1;
  }
  wk.scores.resize(static_cast<size_t>(workers) * kMaxAttendQueries * max_len);
  const int n_items = static_cast<int>(items.size() / 4);
  Pool::get().run(workers, n_items, [&](int it, int w) {
    const float* qs[kMaxAttendQueries];
    float* outs[kMaxAttendQueries];
    int lens[kMaxAttendQueries];
    {
      const int r0 = items[4 * it], g = items[4 * it + 1], q0 = items[4 * it + 2], q1 = items[4 * it + 3];
      for (int q = q0; q < q1; ++q) {  // query q: row r0 + q / group, head g * group + q % group
        const int r = r0 + q / group, h = g * group + q % group;
        qs[q - q0] = wk.qkv.data() + static_cast<int64_t>(r) * width + h * hd;
        outs[q - q0] = wk.att.data() + static_cast<int64_t>(r) * nh * hd + h * hd;
        lens[q - q0] = bt.pos[r] + 1;
      }
      const OsdSeq& sq = bt.seqs[bt.seq[r0]];
      const int64_t off = layer * sq.s_layer + g * sq.s_head;
      attend_rows(qs, lens, q1 - q0, sq.k + off, sq.v + off, sq.s_pos, hd, md.attn_scale,
                  wk.scores.data() + static_cast<int64_t>(w) * kMaxAttendQueries * max_len, outs);
    }
  });
}

// One GEMM of either weight format: Q4 (the target's layers) or Q8 (the head's and a head draft's).
void gemm_as(bool q4, const uint8_t* w, int n, int k, const Act& a, int m, float* y, int ldy, bool add, int threads) {
  if (q4) gemm<true>(w, n, k, a, m, y, ldy, add, threads);
  else gemm<false>(w, n, k, a, m, y, ldy, add, threads);
}

void layer_forward(const OsdModel& md, const OsdBatch& bt, int l, Work& wk, int threads, bool q4 = true) {
  const OsdLayer& ly = md.layers[l];
  const int m = bt.n_rows, d = md.hidden, hd = md.head_dim;
  const int qkv_w = (md.n_heads + 2 * md.n_kv) * hd, att_w = md.n_heads * hd;
  norm_quantize(wk.x.data(), ly.ln1, m, d, md.eps, wk, threads);
  gemm_as(q4, ly.wqkv, qkv_w, d, wk.qa.act(d), m, wk.qkv.data(), qkv_w, false, threads);
  attention(md, bt, l, wk, threads);
  quantize_rows(wk.att.data(), m, att_w, att_w, wk.qa, threads);
  gemm_as(q4, ly.wo, d, att_w, wk.qa.act(att_w), m, wk.x.data(), d, true, threads);
  if (ly.bo)
    for (int r = 0; r < m; ++r)
      for (int i = 0; i < d; ++i) wk.x[static_cast<size_t>(r) * d + i] += ly.bo[i];
  norm_quantize(wk.x.data(), ly.ln2, m, d, md.eps, wk, threads);
  gemm_as(q4, ly.wgu, 2 * md.inter, d, wk.qa.act(d), m, wk.gu.data(), 2 * md.inter, false, threads);
  make_quantize(m, md.inter, wk.qa, threads, [&](int r) {
    float* out = wk.act.data() + static_cast<int64_t>(r) * md.inter;
    swiglu(wk.gu.data() + static_cast<int64_t>(r) * 2 * md.inter, md.inter, out);
    return out;
  });
  gemm_as(q4, ly.wd, d, md.inter, wk.qa.act(md.inter), m, wk.x.data(), d, true, threads);
}

void size_work(const OsdModel& md, int m, Work& wk) {
  wk.x.resize(static_cast<size_t>(m) * md.hidden);
  wk.qkv.resize(static_cast<size_t>(m) * (md.n_heads + 2 * md.n_kv) * md.head_dim);
  wk.att.resize(static_cast<size_t>(m) * md.n_heads * md.head_dim);
  wk.gu.resize(static_cast<size_t>(m) * 2 * md.inter);
  wk.act.resize(static_cast<size_t>(m) * md.inter);
}

// The final norm and the LM head on the batch's logit rows.
void logits_out(const OsdModel& md, const OsdBatch& bt, Work& wk, int threads) {
  const int nl = bt.n_logit_rows, d = md.hidden;
  if (nl == 0) return;
  std::vector<float>& sel = wk.gu;  // free again: the selected rows' hidden states
  sel.resize(static_cast<size_t>(nl) * d);
  for (int i = 0; i < nl; ++i)
    std::memcpy(sel.data() + static_cast<size_t>(i) * d, wk.x.data() + static_cast<size_t>(bt.logit_rows[i]) * d,
                sizeof(float) * d);
  norm_quantize(sel.data(), md.norm, nl, d, md.eps, wk, threads);
  gemm<false>(md.head, md.vocab, d, wk.qa.act(d), nl, bt.logits, md.vocab, false, threads);
}

int check(const OsdModel& md, const OsdBatch& bt) {
  if (md.vocab % kTile || md.hidden % kBlock || md.inter % kBlock || (md.n_heads * md.head_dim) % kBlock) return 1;
  if (md.head_dim % kLanes || md.head_dim > 256 || md.n_heads % md.n_kv) return 2;
  for (int r = 0; r < bt.n_rows; ++r)
    if (bt.pos[r] < 0 || bt.pos[r] >= md.max_pos || bt.tokens[r] < 0 || bt.tokens[r] >= md.n_tokens) return 3;
  for (int i = 0; i < bt.n_logit_rows; ++i)
    if (bt.logit_rows[i] < 0 || bt.logit_rows[i] >= bt.n_rows) return 4;
  for (int i = 0; i < bt.n_feat_layers; ++i)
    if (bt.feat_layers[i] < 0 || bt.feat_layers[i] >= md.n_layers) return 5;
  return 0;
}

// A forward's frame: the arguments checked before any write, one call at a time, the pool
// hot, the calling thread's buffers sized; `body` fills wk.x with the last layer's outputs,
// then the logit rows are taken.
template <class Body>
int32_t run_forward(const OsdModel& md, const OsdBatch& bt, Body&& body) {
  if (const int err = check(md, bt)) return err;
  std::lock_guard<std::mutex> hold(forward_lock());
  new_call();
  Pool::Hot hot;
  Work& wk = work();
  const int threads = std::max(bt.n_threads, 1);
  size_work(md, bt.n_rows, wk);
  body(wk, bt.n_rows, md.hidden, threads);
  logits_out(md, bt, wk, threads);
  return 0;
}

}  // namespace
}  // namespace osd

extern "C" {

int osd_isa(void) { return osd::kIsa; }

// Whether GEMMs of a few rows (kSmallRows) prefetch the next weight tile (process-wide; on by default).
void osd_set_prefetch(int32_t on) { osd::prefetch_small().store(on != 0); }

// AMX row tiles for calls of at least `rows` rows (0: never); returns whether AMX runs here.
int32_t osd_set_amx(int32_t rows) {
#ifdef OSD_AMX
  const bool ok = osd::amx_supported();
  osd::amx_min_rows().store(ok && rows > 0 ? rows : 0);
  return ok ? 1 : 0;
#else
  (void)rows;
  return 0;
#endif
}

// The pool's contract under load (tests/test_native_pool.py): `phases` phases of
// `lo` to `hi` items on `threads` threads, each item yielding its core now and then as a
// preempted worker would; returns the number of items run other than exactly once.
int32_t osd_pool_check(int32_t threads, int32_t phases, int32_t lo, int32_t hi) {
  std::lock_guard<std::mutex> hold(osd::forward_lock());
  osd::Pool::Hot hot;
  std::vector<std::atomic<int>> hits(static_cast<size_t>(std::max(hi, 1)));
  int32_t bad = 0;
  uint32_t state = 12345;
  for (int p = 0; p < phases; ++p) {
    state = state * 1664525u + 1013904223u;
    const int count = lo + static_cast<int>((state >> 8) % static_cast<uint32_t>(hi - lo + 1));
    for (int i = 0; i < count; ++i) hits[i].store(0, std::memory_order_relaxed);
    osd::Pool::get().run(threads, count, [&](int i, int) {
      if ((i * 7 + p) % 13 == 0) sched_yield();
      hits[i].fetch_add(1, std::memory_order_relaxed);
    });
    for (int i = 0; i < count; ++i) bad += hits[i].load(std::memory_order_relaxed) != 1;
  }
  return bad;
}

// Quantize x [M, K] and multiply by a packed weight [N, K]: y [M, N] (tests and benches).
void osd_gemm(const uint8_t* w, int32_t q4, int32_t n, int32_t k, const float* x, int32_t m, float* y,
              int32_t threads) {
  std::lock_guard<std::mutex> hold(osd::forward_lock());
  osd::new_call();
  osd::Quantized qa;
  osd::quantize_rows(x, m, k, k, qa, 1);
  if (q4) osd::gemm<true>(w, n, k, qa.act(k), m, y, n, false, threads);
  else osd::gemm<false>(w, n, k, qa.act(k), m, y, n, false, threads);
}

// Each row of x [rows, v]: its argmax into amax [rows], and with k > 0 its k largest entries
// ids [rows, k] and log-probabilities lps [rows, k] (logits.h). Returns 0, or 1 where a row
// holds a NaN or +inf, or k is out of range (then nothing written is to be used).
int32_t osd_logit_stats(const float* x, int32_t rows, int32_t v, int32_t k, int64_t* amax, int64_t* ids, float* lps,
                        int32_t threads) {
  if (k < 0 || k > osd::kMaxTopK || k > v || v < 1) return 1;
  std::lock_guard<std::mutex> hold(osd::forward_lock());
  std::atomic<bool> ok{true};
  // The pool's workers sleep between forwards: waking them pays only for a batch's rows.
  osd::Pool::get().run(rows >= osd::kThreadedLogitRows ? std::max(threads, 1) : 1, rows, [&](int r, int) {
    const int64_t o = static_cast<int64_t>(r) * k;
    if (!osd::logit_row(x + static_cast<int64_t>(r) * v, v, k, amax + r, ids + o, lps + o)) ok.store(false);
  });
  return ok.load() ? 0 : 1;
}

// The whole forward; returns 0, or a code for arguments out of range (checked before any write).
int32_t osd_forward(const OsdModel* md, const OsdBatch* bt) {
  using namespace osd;
  return run_forward(*md, *bt, [&](Work& wk, int m, int d, int threads) {
    for (int r = 0; r < m; ++r) {
      const uint16_t* e = md->embed + bt->tokens[r] * d;
      for (int i = 0; i < d; ++i) wk.x[static_cast<size_t>(r) * d + i] = bf16_to_float(e[i]);
    }
    const int feat_w = bt->n_feat_layers * d;
    for (int l = 0; l < md->n_layers; ++l) {
      layer_forward(*md, *bt, l, wk, threads);
      for (int f = 0; f < bt->n_feat_layers; ++f) {
        if (bt->feat_layers[f] != l) continue;
        for (int r = 0; r < m; ++r)
          for (int i = 0; i < d; ++i)
            bt->feats[static_cast<int64_t>(r) * feat_w + f * d + i] = float_to_bf16(wk.x[static_cast<size_t>(r) * d + i]);
      }
    }
  });
}

// A head draft's rows: the one-layer model `md` (Q8 layer weights, its own K/V caches in
// `bt`'s sequences, `md->head` its draft-vocabulary LM head) over inputs made from `in->g` and
// `bt->tokens`; every row's output state into `in->states`, the logits of `bt`'s logit rows.
// Returns 0, or check()'s code, or 6 for a model of more than one layer or features asked for.
int32_t osd_head_forward(const OsdModel* md, const OsdHeadIn* in, const OsdBatch* bt) {
  using namespace osd;
  if (md->n_layers != 1 || bt->n_feat_layers != 0) return 6;
  return run_forward(*md, *bt, [&](Work& wk, int m, int d, int threads) {
    wk.tmp.resize(static_cast<size_t>(m) * 2 * d);
    make_quantize(m, 2 * d, wk.qa, threads, [&](int r) {
      float* out = wk.tmp.data() + static_cast<int64_t>(r) * 2 * d;
      const uint16_t* e = md->embed + bt->tokens[r] * d;
      for (int i = 0; i < d; ++i) out[d + i] = bf16_to_float(e[i]);
      rms_norm(out + d, in->norm_e, d, md->eps, out);
      rms_norm(in->g + static_cast<int64_t>(r) * d, in->norm_g, d, md->eps, out + d);
      return out;
    });
    gemm<false>(in->in_proj, d, 2 * d, wk.qa.act(2 * d), m, wk.x.data(), d, false, threads);
    layer_forward(*md, *bt, 0, wk, threads, false);
    std::memcpy(in->states, wk.x.data(), sizeof(float) * static_cast<size_t>(m) * d);
  });
}

}  // extern "C"
