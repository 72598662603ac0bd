"""One target forward over the new rows of several sequences: the batched step.

Each sequence brings its rows (1 to decode, k+1 to verify, a prompt chunk to prefill); they
are concatenated, ragged, into one [N, D] block, so every linear reads its weights once per
step instead of once per sequence. Attention stays per sequence, over its own cache:
- sequences of one row whose caches lie in one KVPool attend together: one bmm over a view
  of the adjacent pool slots, positions past each sequence's length masked;
- the others (verify blocks, prompt chunks, caches outside a pool) attend alone, exactly as
  a solo forward of their rows does (runner.attention); a draft tree's nodes attend under
  their ancestor mask, rotated to their depths (Item.pos, Item.visible).

Weights by rows: up to WIDE_ROWS rows the runner's step weights (int4 for an int4 target),
beyond that its prompt weights (the model's own bfloat16, fused), because the weight-only
int4 and int8 kernels cost about as much per row at any row count, while oneDNN's dense
GEMM reuses each weight across rows; the head likewise beyond WIDE_HEAD_ROWS rows.
The native runner (serve/model/native_runner.py) takes the whole batch in one call of its
own. On a GPU, the rows of every sequence with logits run in one pool forward of bucketed
shapes (serve/model/pool_forward.py; the CUDA-graph runner replays it as a graph), and the
step's prompt chunks together in one eager forward (each attends alone). A target that is none of these (HFRunner) runs its sequences one
forward each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from serve.model.pool_forward import pool_rows, run_rows
from serve.model.runner import LlamaRunner, StaticKVCache, attention

# Rows up to which a batched forward uses the step weights (module doc): past them the bfloat16
# weights, which reuse each weight across rows, are the faster (docs/benchmarks.md, "Rows
# against weight formats"). The int8 head's bound stays at k + 1 and above, so a verify block
# beside a decode row still reads the head a decode step reads.
WIDE_ROWS = 24
WIDE_HEAD_ROWS = 8
# A GPU step's sequences of up to this many rows ride in the pool forward (verify blocks and
# decode rows); longer ones (prompt chunks) share one eager forward beside it.
POOL_MAX_ROWS = 32


@dataclass
class Item:
    tokens: torch.Tensor  # [T] new tokens, appended to `cache`
    cache: Any
    logits: bool = True  # False: a prompt chunk (KV and features only)
    # A block that is not a chain (a draft tree's nodes): row i still goes to cache slot
    # length+i, but is rotated to position pos[i] and attends where visible[i] [max_len] marks.
    pos: torch.Tensor | None = None
    visible: torch.Tensor | None = None


Output = tuple["torch.Tensor | None", "torch.Tensor | None"]  # (logits [T, V] fp32, features [T, F])


def forward_batch(runner: Any, items: list[Item], layers: tuple[int, ...] = (), pool: bool | None = None) -> list[Output]:
    """Run every item's rows; returns per item (logits or None, features of `layers` or None).
    pool: the GPU's pool forward (default: on a GPU; tests take it on the CPU)."""
    if hasattr(runner, "forward_rows"):  # the native forward takes a batch in one call
        return runner.forward_rows(items, layers)
    if pool is None:
        pool = runner.device.type == "cuda"
    if pool and isinstance(runner, LlamaRunner) and len(items) > 1:
        with torch.inference_mode():
            return pooled(runner, items, layers)
    if type(runner) is not LlamaRunner or runner.device.type != "cpu" or len(items) == 1:
        return [_solo(runner, it, layers) for it in items]
    with torch.inference_mode():
        return _batched(runner, items, layers)


def _solo(runner: Any, it: Item, layers: tuple[int, ...]) -> Output:
    if it.visible is not None:  # the runner's masked forward (a CUDA graph per size on a GPU)
        t = it.tokens.shape[0]
        reserve([it], [t])
        start = torch.arange(it.cache.length, it.cache.length + 1, device=it.tokens.device)
        out = runner.forward_masked(it.tokens, start, it.pos, it.visible, it.cache, layers)
        it.cache.length += t
        return out
    if not it.logits:
        return None, runner.prefill(it.tokens, it.cache, layers)
    if layers:
        return runner.forward_features(it.tokens, it.cache, layers)
    return runner.forward(it.tokens, it.cache), None


def pooled(r: LlamaRunner, items: list[Item], layers: tuple[int, ...] = ()) -> list[Output]:
    """The GPU's batched step (module doc): the items with logits whose caches share one pool
    in one pool forward (through the runner's graphs where it has them), the rest alone."""
    pool = next((it.cache.pool for it in items if it.cache.pool is not None), None)
    ride = [i for i, it in enumerate(items)
            if it.logits and it.visible is None and pool is not None and it.cache.pool is pool
            and it.tokens.numel() <= POOL_MAX_ROWS]
    out: list[Output] = [(None, None)] * len(items)
    if len(ride) > 1:
        its = [items[i] for i in ride]
        sizes = [it.tokens.numel() for it in its]
        reserve(its, sizes)
        rows = pool_rows(pool, [it.tokens for it in its], [it.cache for it in its], r.device)
        run = getattr(r, "forward_pool", None)  # the CUDA-graph runner's graphs
        logits, feats = run(pool, rows, layers) if run is not None else run_rows(r, pool, rows, layers)
        lo = 0
        for i, it, t in zip(ride, its, sizes):
            it.cache.length += t
            out[i] = (logits[lo:lo + t], feats[lo:lo + t] if feats is not None else None)
            lo += t
    else:
        ride = []
    rest = sorted(set(range(len(items))) - set(ride))
    if len(rest) > 1:  # prompt chunks: one eager forward for all (each attends alone)
        for i, o in zip(rest, _batched(r, [items[i] for i in rest], layers)):
            out[i] = o
    elif rest:
        out[rest[0]] = _solo(r, items[rest[0]], layers)
    return out


def _batched(r: LlamaRunner, items: list[Item], layers: tuple[int, ...]) -> list[Output]:
    # One-row items in a shared pool first (they attend together), the rest after, each alone.
    pooled = [i for i, it in enumerate(items)
              if it.tokens.shape[0] == 1 and it.cache.pool is not None and it.visible is None]
    pools = {id(items[i].cache.pool) for i in pooled}
    if len(pools) > 1:
        pooled = [i for i in pooled if id(items[i].cache.pool) == id(items[pooled[0]].cache.pool)]
    if pooled:  # a context far longer than the others' attends alone: the rest need not pad to it
        lengths = sorted(items[i].cache.length for i in pooled)
        cap = 2 * lengths[len(lengths) // 2] + 64
        pooled = [i for i in pooled if items[i].cache.length <= cap]
    pooled_set = set(pooled)
    order = pooled + [i for i in range(len(items)) if i not in pooled_set]
    its = [items[i] for i in order]
    sizes = [it.tokens.shape[0] for it in its]
    starts = [it.cache.length for it in its]
    reserve(its, sizes)
    n = sum(sizes)
    tokens = torch.cat([it.tokens for it in its])
    pos = torch.cat([r.arange[s:s + t] if it.pos is None else it.pos for it, s, t in zip(its, starts, sizes)])
    offsets = _offsets(sizes)
    attend = _attend(r, its, sizes, offsets, starts, len(pooled), pos)
    blocks = r.prefill_blocks if n > WIDE_ROWS else r.blocks
    h, feats = r.stack(tokens, r.cos.index_select(0, pos), r.sin_signed.index_select(0, pos), attend, layers, blocks)
    for it, t in zip(its, sizes):
        it.cache.length += t
    rows = [j for j, it in enumerate(its) if it.logits]
    logits = None
    if rows:
        idx = torch.cat([r.arange[offsets[j]:offsets[j] + sizes[j]] for j in rows])
        x = h if idx.numel() == n else h.index_select(0, idx)
        head = r.wide_head if idx.numel() > WIDE_HEAD_ROWS else r.head
        logits = head(F.rms_norm(x, r.hidden, r.norm, r.eps)).float()
    out: list[Output] = [(None, None)] * len(items)
    lo = 0
    for j, (i, t) in enumerate(zip(order, sizes)):
        lg = None
        if its[j].logits:
            lg, lo = logits[lo:lo + t], lo + t
        out[i] = (lg, feats[offsets[j]:offsets[j] + t] if feats is not None else None)
    return out


def reserve(items: list[Item], sizes: list[int]) -> None:
    """Room in every item's cache for its new rows, checked for all before any grows."""
    for it, t in zip(items, sizes):
        if it.cache.length + t > it.cache.max_len:
            raise ValueError(f"sequence of {it.cache.length + t} tokens exceeds the cache's {it.cache.max_len}")
    for it, t in zip(items, sizes):
        it.cache.reserve(it.cache.length + t)


def _offsets(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for t in sizes:
        out.append(acc)
        acc += t
    return out


def _attend(r: LlamaRunner, its: list[Item], sizes: list[int], offsets: list[int], starts: list[int],
            n_pooled: int, pos: torch.Tensor):
    """decoder_layer's attend over the ragged rows: writes each row's K/V into its cache and
    returns the attention outputs [N, H*hd] in row order."""
    gqa = r.n_kv != r.n_heads
    caches: list[StaticKVCache] = [it.cache for it in its]
    masks = [it.visible[:, :s + t] if it.visible is not None else None if t == 1 else r.causal[s:s + t, :s + t]
             for it, s, t in zip(its, starts, sizes)]
    pooled = caches[:n_pooled]
    if pooled:
        pool = pooled[0].pool
        slot_ids = [c.index for c in pooled]
        lo, hi = min(slot_ids), max(slot_ids) + 1
        slot_t = torch.tensor(slot_ids, dtype=torch.long, device=r.device)
        write_pos = pos[:n_pooled]
        span = max(s + 1 for s in starts[:n_pooled])
        if 2 * span >= pool.capacity:  # whole slot rows: contiguous for bmm, at most 2x the positions
            span = pool.capacity
        lengths = torch.ones(hi - lo, dtype=torch.long, device=r.device)
        lengths[slot_t - lo] = torch.tensor([s + 1 for s in starts[:n_pooled]], device=r.device)
        visible = (r.arange[:span].unsqueeze(0) < lengths.unsqueeze(1))  # [slots, span]

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        parts = []
        if pooled:
            pool.k[i, slot_t, :, write_pos] = k[:n_pooled]
            pool.v[i, slot_t, :, write_pos] = v[:n_pooled]
            k_view, v_view = pool.k[i, lo:hi], pool.v[i, lo:hi]
            if span < pool.capacity:
                k_view, v_view = k_view[:, :, :span], v_view[:, :, :span]
            parts.append(_pooled_attention(q[:n_pooled], k_view, v_view, slot_t - lo, visible, r.n_kv))
        for j in range(n_pooled, len(its)):
            c, a, t = caches[j], offsets[j], sizes[j]
            end = starts[j] + t
            c.k[i, :, starts[j]:end] = k[a:a + t].transpose(0, 1)
            c.v[i, :, starts[j]:end] = v[a:a + t].transpose(0, 1)
            parts.append(attention(q[a:a + t], c.k[i, :, :end], c.v[i, :, :end], masks[j], gqa))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    return attend


def _pooled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                      visible: torch.Tensor, n_kv: int) -> torch.Tensor:
    """One query row per sequence, q [B, H, hd], against the pool view k/v [S, KV, L, hd] of
    adjacent slots (slot of row b: rows[b]); visible [S, L] marks each slot's filled positions.
    The arithmetic of runner.attention for one row (bmm in the cache dtype, float32 softmax)."""
    b, nh, hd = q.shape
    s, _, span, _ = k.shape
    group = nh // n_kv
    qs = q.new_zeros(s, nh, hd)
    qs[rows] = q
    qg = qs.view(s * n_kv, group, hd)
    scores = torch.bmm(qg, k.reshape(s * n_kv, span, hd).transpose(1, 2)).float().mul_(hd ** -0.5)
    scores = scores.view(s, n_kv * group, span).masked_fill_(~visible.unsqueeze(1), float("-inf"))
    out = torch.bmm(scores.view(s * n_kv, group, span).softmax(-1).to(v.dtype), v.reshape(s * n_kv, span, hd))
    return out.view(s, nh * hd).index_select(0, rows)
