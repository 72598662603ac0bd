"""The head draft's serving math over fused weights, optionally quantized (serve/model/linear.py).

Same computation as infra/drafts/head.py's `mix -> qkv -> attend -> logits` (which training
keeps), written as the target's lean forward is: q|k|v and gate|up as one GEMM each, fused
RMSNorm, RoPE without concatenation, one row's attention as two small bmm. On 2 CPU
cores a head row costs a few milliseconds through nn.Linear modules, a large share of an
int4 target step; with int8 weights (beside an int4 target: serve/spec_decode/head/draft.py HEAD_QUANT)
it reads half the bytes. A draft may be anything: verification keeps the output the
target's, so quantizing the head changes only how often its tokens are accepted (int4 codes
cost it about 0.07 acceptance, int8 almost none).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from serve.model.runner import Block, StaticKVCache, decoder_layer, prefix_attend, shared_linear


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
        # The one decoder layer, as the target's blocks: (ln1, q|k|v, o, ln2, gate|up, down).
        self.block = Block(head.ln1.detach(), linear(layer["q_proj"], layer["k_proj"], layer["v_proj"]),
                           linear(layer["o_proj"]), head.ln2.detach(),
                           linear(layer["gate_proj"], layer["up_proj"]), linear(layer["down_proj"]))
        self.lm_head = linear(head.lm_head)
        self.norm_e, self.norm_g, self.norm = head.norm_e.detach(), head.norm_g.detach(), head.norm.detach()
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
        end = start + next_ids.shape[0]
        e = F.embedding(next_ids, self.embed)
        x = self.in_proj(torch.cat([self._rms(e, self.norm_e), self._rms(g, self.norm_g)], dim=-1))
        attend = prefix_attend(cache, start, end, mask, self.n_kv != self.n_heads)
        x = decoder_layer(x, self.block, self.cos[start:end], self.sin_signed[start:end], attend, 0,
                          self.n_heads, self.n_kv, self.head_dim, self.eps)
        last = x[-1:]
        return self.lm_head(self._rms(last, self.norm)).float()[0], last

    def rows_batch(self, gs: list[torch.Tensor], nexts: list[torch.Tensor], caches: list[StaticKVCache],
                   masks: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """rows() for several sequences in one pass (batched drafting): each sequence's rows
        at its own cache's next slots, attending to its own cache. Returns each sequence's last
        row's draft-vocab logits [B, V_d] fp32 and output state [B, h]; leaves the caches'
        lengths to the caller."""
        sizes = [n.shape[0] for n in nexts]
        starts = [c.length for c in caches]
        e = F.embedding(torch.cat(nexts), self.embed)
        x = self.in_proj(torch.cat([self._rms(e, self.norm_e), self._rms(torch.cat(gs), self.norm_g)], dim=-1))
        pos = torch.cat([torch.arange(s, s + t, device=x.device) for s, t in zip(starts, sizes)])
        attends = [prefix_attend(c, s, s + t, m, self.n_kv != self.n_heads)
                   for c, s, t, m in zip(caches, starts, sizes, masks)]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out, a = [], 0
            for fn, t in zip(attends, sizes):
                out.append(fn(i, q[a:a + t], k[a:a + t], v[a:a + t]))
                a += t
            return torch.cat(out)

        x = decoder_layer(x, self.block, self.cos.index_select(0, pos), self.sin_signed.index_select(0, pos),
                          attend, 0, self.n_heads, self.n_kv, self.head_dim, self.eps)
        last = x.index_select(0, torch.tensor(sizes, device=x.device).cumsum(0) - 1)
        return self.lm_head(self._rms(last, self.norm)).float(), last
