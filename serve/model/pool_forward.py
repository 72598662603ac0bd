"""The batched step on a GPU: one forward over the rows of every sequence whose cache lies in
one KVPool, with each shape fixed by a few bucketed sizes, so the step can be replayed as a
CUDA graph (serve/model/cuda_graphs.py GraphLlamaRunner.forward_pool) or run eagerly.

Rows are ragged: sequence b brings T_b rows (1 to decode, k+1 to verify). The linears run over
the N rows, padded to a bucket. Attention runs over a grid of query rows, one line per
sequence (padded to a bucket of lines) and T columns (the longest T_b, bucketed): each line
attends to its own slot's K/V, gathered up to the attended span, under a causal-by-position
mask, in one fused attention call per layer for every sequence at once. Padding rows write
their K/V into the pool's spare slot (KVPool.spare), which no sequence owns, and sit on a
line of their own. No shape depends on which slots the sequences hold, so one graph per
bucket serves every slot, a request alone included (GraphLlamaRunner).

Why not per-sequence attention (serve/model/batch_forward.py's CPU path): on a GPU each call is
a launch, so B sequences cost B launches a layer, and their shapes change every step, which
no graph can replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from serve.model.runner import KVPool, LlamaRunner

MIN_SPAN = 256  # the attended positions, bucketed in powers of two from here to max_len


def bucket(n: int, lo: int = 1) -> int:
    """The power of two (from lo) that holds n."""
    b = lo
    while b < n:
        b *= 2
    return b


@dataclass(frozen=True)
class PoolRows:
    """A step's rows as the pool forward takes them, padded to `tokens.shape[0]` (a bucket):
    tokens, the slot and position each row is written at, and its place in the grid."""
    tokens: torch.Tensor  # [rows]
    slot: torch.Tensor  # [rows]; padding: the pool's spare slot
    pos: torch.Tensor  # [rows]; padding: 0
    line: torch.Tensor  # [rows]: the row's grid line (its sequence's; padding: the last line)
    col: torch.Tensor  # [rows]: the row's index within its sequence
    line_slot: torch.Tensor  # [lines]: each line's slot (padding lines: the spare)
    n: int  # real rows, the first n
    width: int  # grid columns (longest sequence's rows, bucketed)
    span: int  # positions attended (the furthest sequence's end, bucketed)

    @property
    def key(self) -> tuple[int, int, int, int]:
        return self.tokens.shape[0], self.line_slot.shape[0], self.width, self.span

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.tokens, self.slot, self.pos, self.line, self.col, self.line_slot


def pool_rows(pool: KVPool, tokens: list[torch.Tensor], caches: list[Any], device: torch.device) -> PoolRows:
    """The rows of sequences in `pool`: tokens[b] appended to caches[b] (their lengths not moved)."""
    sizes = [t.numel() for t in tokens]
    n = sum(sizes)
    rows = bucket(n)
    pad = rows - n
    # Padding rows get a line of their own; with one row a sequence, each its own (lines = rows,
    # so decode-only steps add no shape to the graphs' keys).
    lines = rows if max(sizes) == 1 else bucket(len(caches) + (pad > 0))
    slot, pos, line, col = [], [], [], []
    for b, (c, t) in enumerate(zip(caches, sizes)):
        slot += [c.index] * t
        pos += range(c.length, c.length + t)
        line += [b] * t
        col += range(t)
    pad_lines = list(range(n, rows)) if max(sizes) == 1 else [lines - 1] * pad
    line_slot = [c.index for c in caches] + [pool.spare] * (lines - len(caches))
    span = min(pool.capacity, max(MIN_SPAN, bucket(max(c.length + t for c, t in zip(caches, sizes)))))
    host = torch.tensor(slot + [pool.spare] * pad + pos + [0] * pad + line + pad_lines + col + [0] * pad
                        + line_slot, dtype=torch.long)
    host = host.pin_memory() if device.type == "cuda" else host
    on = host.to(device, non_blocking=True)
    toks = torch.cat(tokens + [tokens[0].new_zeros(pad)]) if pad else torch.cat(tokens)
    return PoolRows(toks, on[:rows], on[rows:2 * rows], on[2 * rows:3 * rows], on[3 * rows:4 * rows], on[4 * rows:],
                    n, bucket(max(sizes)), span)


def run_rows(r: LlamaRunner, pool: KVPool, rows: PoolRows,
             layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """pool_forward over PoolRows, eagerly."""
    return pool_forward(r, pool, *rows.inputs, rows.width, rows.span, layers)


def pool_forward(r: LlamaRunner, pool: KVPool, tokens: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor,
                 line: torch.Tensor, col: torch.Tensor, line_slot: torch.Tensor, width: int, span: int,
                 layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits [rows, V] float32, features of `layers`) for PoolRows' tensors; writes every
    row's K/V into the pool. Shapes depend on (rows, lines, width, span) alone."""
    lines = line_slot.shape[0]
    nh, nkv, hd = r.n_heads, r.n_kv, r.head_dim
    group = nh // nkv
    at = torch.zeros(lines, width, dtype=torch.long, device=pos.device)
    at[line, col] = pos
    # [lines, 1, group * width, span], rows ordered (group, column) as the queries below
    visible = (torch.arange(span, device=pos.device) <= at.unsqueeze(-1)).repeat(1, group, 1).unsqueeze(1)
    rows = tokens.shape[0]

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pool.k[i][slot, :, pos] = k
        pool.v[i][slot, :, pos] = v
        keys = pool.k[i][:, :, :span].index_select(0, line_slot)  # [lines, KV, span, hd]
        values = pool.v[i][:, :, :span].index_select(0, line_slot)
        grid = q.new_zeros(lines, width, nh, hd)
        grid[line, col] = q
        qg = grid.view(lines, width, nkv, group, hd).permute(0, 2, 3, 1, 4).reshape(lines, nkv, group * width, hd)
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=visible)
        o = o.view(lines, nkv, group, width, hd).permute(0, 3, 1, 2, 4)  # [lines, width, KV, G, hd]
        return o[line, col].reshape(rows, nh * hd)

    return r._decoder(tokens, r.cos.index_select(0, pos), r.sin_signed.index_select(0, pos), attend, layers)
