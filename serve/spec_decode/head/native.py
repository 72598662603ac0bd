"""The head draft's rows on the native kernels (serve/model/native/forward.cpp osd_head_forward):
what LeanHead (serve/spec_decode/head/lean.py) computes, in one library call per draft step.

Beside a native int4 target a head row through PyTorch cost a large share of a target step
(a dozen small ops; docs/benchmarks.md), so the cost rule seldom let the head draft. Here
its weights are Q8 blocks (as LeanHead's int8 beside an int4 target: the native target's LM
head format), its activations quantized per row as the target's are, and its K/V caches are
the bfloat16 StaticKVCaches LeanHead writes, so the two may take turns on one request (draft
trees keep the PyTorch path). Its drafts differ from LeanHead's by quantization rounding
only; verification keeps the output the target's either way.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.nn.functional as F

from serve.model.native_build import NativeUnavailable, load
from serve.model.native_formats import TILE, pack_q8
from serve.model.native_runner import ERRORS, OsdBatch, OsdLayer, OsdModel, forward_threads, rows_of, tiles_unsupported
from serve.model.runner import StaticKVCache

HEAD_ERRORS = {**ERRORS, 6: "a model of more than one layer, or features asked of a head"}


class OsdHeadIn(ctypes.Structure):
    _fields_ = [("in_proj", ctypes.c_void_p), ("norm_e", ctypes.c_void_p), ("norm_g", ctypes.c_void_p),
                ("g", ctypes.c_void_p), ("states", ctypes.c_void_p)]


def head_unsupported(head: Any) -> str | None:
    """None where the native kernels can run `head`, else why not."""
    if head.embed.dtype != torch.bfloat16:
        return f"its embedding is {head.embed.dtype} (the native caches are bfloat16)"
    return tiles_unsupported(head.head_dim, (("hidden size", head.embed.shape[1]),
                                             ("intermediate size", head.layer["gate_proj"].weight.shape[0]),
                                             ("attention width", head.n_heads * head.head_dim)))


def _q8(*ws: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    w = torch.cat([x.detach().float() for x in ws]) if len(ws) > 1 else ws[0].detach().float()
    if rows is not None and rows != w.shape[0]:
        w = F.pad(w, (0, 0, 0, rows - w.shape[0]))  # whole tiles: the padded rows' logits are dropped
    return pack_q8(w)


class NativeHead:
    """LeanHead's rows(), rows_batch() and fuse() on the native library."""

    def __init__(self, head: Any, lib: ctypes.CDLL | None = None):
        why = head_unsupported(head)
        if why:
            raise NativeUnavailable(f"the native head cannot run this head: {why}")
        self.lib = lib if lib is not None else load()
        try:
            self._call = self.lib.osd_head_forward
        except AttributeError:
            raise NativeUnavailable("this native library has no head forward (an older build)") from None
        self._call.restype = ctypes.c_int32
        self._call.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
        self.dtype = head.embed.dtype
        h, layer = head.embed.shape[1], head.layer
        self.hidden = h
        self.draft_vocab = int(head.d2t.numel())
        self._vocab_rows = -(-self.draft_vocab // TILE) * TILE
        keep: list[Any] = []

        def f32(w: torch.Tensor) -> int:
            out = w.detach().float().contiguous()
            keep.append(out)
            return out.data_ptr()

        self._fc = _q8(head.fc.weight)
        self._fc_out, self._fc_in = head.fc.weight.shape
        self._in_proj = _q8(head.in_proj.weight)
        ws = (_q8(layer["q_proj"].weight, layer["k_proj"].weight, layer["v_proj"].weight), _q8(layer["o_proj"].weight),
              _q8(layer["gate_proj"].weight, layer["up_proj"].weight), _q8(layer["down_proj"].weight))
        lm_head = _q8(head.lm_head.weight, rows=self._vocab_rows)
        self._layer = (OsdLayer * 1)()
        self._layer[0] = OsdLayer(*(w.data_ptr() for w in ws), f32(head.ln1), f32(head.ln2), None, None, None, None)
        half = head.head_dim // 2
        cos = head.cos.float().contiguous()
        sin = torch.cat([-head.sin[:, :half], head.sin[:, half:]], dim=-1).float().contiguous()
        self.embed = head.embed.contiguous()
        self.max_pos = cos.shape[0]
        keep.extend([ws, lm_head, cos, sin, self.embed, self._layer])
        self._model = OsdModel(1, h, head.n_heads, head.n_kv, head.head_dim, layer["gate_proj"].weight.shape[0],
                               self._vocab_rows, self.max_pos, head.vocab_size, float(head.eps),
                               float(head.head_dim ** -0.5), ctypes.addressof(self._layer), self.embed.data_ptr(),
                               f32(head.norm), lm_head.data_ptr(), cos.data_ptr(), sin.data_ptr())
        self._norm_e, self._norm_g = f32(head.norm_e), f32(head.norm_g)
        self._keep = keep  # everything the C structs point into
        # Every call on the forward's threads, one-row draft steps too: beside the target's step
        # the head's ten megabytes come from memory, not cache, and one thread streams them
        # slower than two (docs/benchmarks.md).
        self.threads = forward_threads()

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features [T, nf*h] -> g [T, h] (the head's dtype)."""
        x = feats.reshape(-1, self._fc_in).float().contiguous()
        y = torch.empty(x.shape[0], self._fc_out, dtype=torch.float32)
        if x.shape[0]:
            self.lib.osd_gemm(self._fc.data_ptr(), 0, self._fc_out, self._fc_in, x.data_ptr(), x.shape[0], y.data_ptr(),
                              self.threads)
        return y.to(self.dtype).reshape(*feats.shape[:-1], self._fc_out)

    def rows(self, g: torch.Tensor, next_ids: torch.Tensor, cache: StaticKVCache, start: int,
             mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """LeanHead.rows: rows at cache slots start.. (causal among themselves, as `mask` says);
        the last row's draft-vocab logits [V_d] fp32 and output state [1, h]; leaves cache.length."""
        if start != cache.length:
            raise ValueError("the native head appends rows at the cache's length")
        logits, states = self.rows_batch([g], [next_ids], [cache], [mask])
        return logits[0], states

    def rows_batch(self, gs: list[torch.Tensor], nexts: list[torch.Tensor], caches: list[StaticKVCache],
                   masks: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """LeanHead.rows_batch: each sequence's rows at its cache's next slots, in one call; the
        last rows' logits [B, V_d] fp32 and output states [B, h]; leaves the caches' lengths."""
        sizes = [int(n.shape[0]) for n in nexts]
        n = sum(sizes)
        g = (gs[0] if len(gs) == 1 else torch.cat(gs)).reshape(n, self.hidden)
        tokens = nexts[0] if len(nexts) == 1 else torch.cat(nexts)
        return self._rows(g, tokens, caches, sizes)

    def _rows(self, g: torch.Tensor, tokens: torch.Tensor, caches: list[StaticKVCache],
              sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        n = sum(sizes)
        g = g.float().contiguous()
        tokens = tokens.reshape(-1).to(torch.int64).contiguous()
        for c, t in zip(caches, sizes):
            if c.length + t > c.max_len:
                raise ValueError(f"sequence of {c.length + t} rows exceeds the head cache's {c.max_len}")
        pos, seq, seqs = rows_of(caches, sizes, "the native head needs bfloat16 caches on the CPU")
        last, acc = [], 0
        for t in sizes:
            acc += t
            last.append(acc - 1)
        rows = (ctypes.c_int32 * len(last))(*last)
        logits = torch.empty(len(last), self._vocab_rows, dtype=torch.float32)
        states = torch.empty(n, self.hidden, dtype=torch.float32)
        io = OsdHeadIn(self._in_proj.data_ptr(), self._norm_e, self._norm_g, g.data_ptr(), states.data_ptr())
        batch = OsdBatch(n, tokens.data_ptr(), ctypes.addressof(pos), ctypes.addressof(seq), ctypes.addressof(seqs),
                         len(last), ctypes.addressof(rows), logits.data_ptr(), 0, None, None, self.threads)
        err = self._call(ctypes.byref(self._model), ctypes.byref(io), ctypes.byref(batch))
        if err:
            raise ValueError(f"native head refused its input: {HEAD_ERRORS.get(err, err)}")
        if self._vocab_rows != self.draft_vocab:
            logits = logits[:, :self.draft_vocab]
        return logits, states[last].to(self.dtype)
