"""The head draft's serving math over fused weights, optionally int4 (serve/linear.py).

Same computation as infra/draft_head.py's `mix -> qkv -> attend -> logits` (which training
keeps), written as the target's lean forward is: q|k|v and gate|up as one GEMM each, fused
RMSNorm, RoPE without concatenation, one row's attention as two small bmm. On 2 CPU
cores a head row costs a few milliseconds through nn.Linear modules, a large share of an
int4 target step; with int4 weights it reads a quarter of the bytes. A draft may be
anything: verification keeps the output the target's, so quantizing the head changes
only how often its tokens are accepted.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from serve.runner import StaticKVCache, attention, shared_linear


class LeanHead:
    def __init__(self, head: Any, quant: str = "none"):
        layer = head.layer
        dt = head.embed.dtype

        def linear(*modules: Any):
            return shared_linear(tuple(m.weight for m in modules), quant, dt)

        self.embed = head.embed
        self.n_heads, self.n_kv, self.head_dim = head.n_heads, head.n_kv, head.head_dim
        self.hidden = (head.embed.shape[1],)
        self.eps = head.eps
        self.fc = linear(head.fc)
        self.in_proj = linear(head.in_proj)
        self.qkv = linear(layer["q_proj"], layer["k_proj"], layer["v_proj"])
        self.o = linear(layer["o_proj"])
        self.gate_up = linear(layer["gate_proj"], layer["up_proj"])
        self.down = linear(layer["down_proj"])
        self.lm_head = linear(head.lm_head)
        self.norm_e, self.norm_g = head.norm_e.detach(), head.norm_g.detach()
        self.ln1, self.ln2, self.norm = head.ln1.detach(), head.ln2.detach(), head.norm.detach()
        half = self.head_dim // 2
        self.cos = head.cos.unsqueeze(1)  # [max_pos, 1, hd]
        self.sin_signed = torch.cat([-head.sin[:, :half], head.sin[:, half:]], dim=-1).unsqueeze(1)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.hidden, w, self.eps)

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        return self.fc(feats)

    def rows(self, g: torch.Tensor, next_ids: torch.Tensor, cache: StaticKVCache, start: int,
             mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (inputs g [T, h], next tokens [T]) at cache slots start..start+T, attending
        causally (`mask` [T, start+T] or None for one row). Returns the last row's draft-vocab
        logits [V_d] fp32 and its output state [1, h]; leaves cache.length to the caller."""
        t = next_ids.shape[0]
        end = start + t
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        e = F.embedding(next_ids, self.embed)
        x = self.in_proj(torch.cat([self._rms(e, self.norm_e), self._rms(g, self.norm_g)], dim=-1))
        qkv = self.qkv(self._rms(x, self.ln1)).view(t, nh + 2 * nkv, hd)
        qk = qkv[:, : nh + nkv]
        qk = torch.addcmul(qk * self.cos[start:end], qk.roll(hd // 2, -1), self.sin_signed[start:end])
        cache.k[0, :, start:end] = qk[:, nh:].transpose(0, 1)
        cache.v[0, :, start:end] = qkv[:, nh + nkv:].transpose(0, 1)
        a = attention(qk[:, :nh], cache.k[0, :, :end], cache.v[0, :, :end], mask, nkv != nh)
        x = self.o.add(x, a)
        gate, up = self.gate_up(self._rms(x, self.ln2)).chunk(2, dim=-1)
        x = self.down.add(x, F.silu(gate).mul_(up))
        last = x[-1:]
        return self.lm_head(self._rms(last, self.norm)).float()[0], last
