"""Model runners: one forward over new tokens against a preallocated KV cache.

`LlamaRunner` is a lean re-implementation of the Llama forward over a Hugging Face
LlamaForCausalLM's own weight tensors (no copies). It exists because the per-token Python
and allocation work inside HF's generic forward is a large share of a 135M model's
step on CPU. It mirrors HF's op order (fp32 RMSNorm, rotate-half RoPE, SDPA) so logits
match HF to float rounding.

`HFRunner` wraps any other causal LM through its own forward and DynamicCache, so the
engine accepts any pair of causal LMs that share a vocab; it is slower.

Both expose: new_cache(), forward(tokens [T], cache) -> logits [T, V] (appending T
positions to the cache), cache.truncate(n) for rollback, and cache_key.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F


class KVCache(Protocol):
    length: int

    def truncate(self, n: int) -> None: ...


class Runner(Protocol):
    vocab_size: int
    max_seq_len: int
    device: torch.device

    def new_cache(self) -> KVCache: ...

    @property
    def cache_key(self) -> Any:
        """Equal for runners whose caches are interchangeable, so a request slot keeps one
        draft cache per key and a hot-swapped draft of the same shape reuses it."""
        ...

    def forward(self, tokens: torch.Tensor, cache: Any) -> torch.Tensor: ...


class StaticKVCache:
    """Preallocated keys/values for one sequence: [layers, kv_heads, max_len, head_dim].

    Rollback is O(1): only `length` moves; stale slots past it are overwritten later.
    """

    def __init__(self, layers: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        shape = (layers, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0
        self.max_len = max_len

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.length = n


# Context bound of an HFRunner whose model config declares no max_position_embeddings (a
# model with no position limit of its own); the engine's max_seq_len still applies below it.
HF_CONTEXT_WITHOUT_LIMIT = 4096

_HEAD_T: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _transposed_head(weight: torch.Tensor) -> torch.Tensor:
    """The [D, V] head copy, shared by every runner over the same head tensor: drafts that
    share the target's frozen head (every registry version) would otherwise copy 113 MB each."""
    w = weight.detach()
    key = (w.data_ptr(), tuple(w.shape), w.dtype, str(w.device), w._version)
    if key not in _HEAD_T:
        while len(_HEAD_T) >= 4:
            _HEAD_T.pop(next(iter(_HEAD_T)))
        # Holding the source keeps its memory from being reused, so a data_ptr key stays unique.
        _HEAD_T[key] = (w, w.t().contiguous())
    return _HEAD_T[key][1]


class LlamaRunner:
    def __init__(self, model: Any, max_seq_len: int | None = None):
        cfg = model.config
        if getattr(cfg, "model_type", None) not in ("llama",):
            raise TypeError(f"LlamaRunner needs a Llama model, got {cfg.model_type!r}")
        inner = model.model
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.vocab_size = cfg.vocab_size
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.max_seq_len = min(max_seq_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        # [D, V] copy of the head: MKL's small-M GEMM reads it ~25% faster in this layout,
        # and the head is a fifth of a 135M model's bytes per step.
        self.lm_head_t = _transposed_head(model.lm_head.weight)
        self.layers = [
            (
                layer.input_layernorm.weight,
                layer.self_attn.q_proj.weight,
                layer.self_attn.k_proj.weight,
                layer.self_attn.v_proj.weight,
                layer.self_attn.o_proj.weight,
                layer.post_attention_layernorm.weight,
                layer.mlp.gate_proj.weight,
                layer.mlp.up_proj.weight,
                layer.mlp.down_proj.weight,
            )
            for layer in inner.layers
        ]
        if any(getattr(layer.self_attn.q_proj, "bias", None) is not None for layer in inner.layers):
            raise TypeError("LlamaRunner does not support attention biases; use HFRunner")
        # RoPE tables from the model's own rotary module, so any rope scaling it applies is kept.
        with torch.no_grad():
            pos = torch.arange(self.max_seq_len, device=self.device).unsqueeze(0)
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = inner.rotary_emb(probe, pos)
        self.cos = cos[0]  # [max_seq_len, head_dim]
        self.sin = sin[0]
        self.causal = torch.ones(self.max_seq_len, self.max_seq_len, dtype=torch.bool, device=self.device).tril()
        self.arange = torch.arange(self.max_seq_len, device=self.device)
        self._fused: list[tuple[torch.Tensor, ...]] | None = None

    def new_cache(self) -> StaticKVCache:
        return StaticKVCache(len(self.layers), self.n_kv, self.max_seq_len, self.head_dim, self.dtype, self.device)

    @property
    def cache_key(self) -> tuple:
        """Runners with equal keys can share caches (drafts of one family swap without new memory)."""
        return ("static", len(self.layers), self.n_kv, self.max_seq_len, self.head_dim, self.dtype, str(self.device))

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # Same as HF LlamaRMSNorm: normalise in fp32, cast back, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """tokens: [T] int64 on device -> logits [T, V] fp32; appends T positions to cache."""
        return self._run(tokens, cache, ())[0]

    @torch.inference_mode()
    def forward_features(self, tokens: torch.Tensor, cache: StaticKVCache,
                         layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """As forward, plus the outputs of decoder `layers` (0-based), concatenated:
        (logits [T, V] fp32, features [T, len(layers) * D]). The same single pass: the head
        draft reads what the target computed anyway."""
        return self._run(tokens, cache, layers)

    def _run(self, tokens: torch.Tensor, cache: StaticKVCache,
             layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = tokens.shape[0]
        start = cache.length
        end = start + t
        if end > cache.max_len:
            raise ValueError(f"sequence of {end} tokens exceeds the cache's {cache.max_len}")
        # One query block attends to everything cached plus itself, causally.
        mask = None if t == 1 else self.causal[start:end, :end]

        def attend(i: int, q, k, v):
            cache.k[i, :, start:end] = k
            cache.v[i, :, start:end] = v
            return F.scaled_dot_product_attention(
                q, cache.k[i, :, :end], cache.v[i, :, :end], attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)

        out = self._layers(tokens, self.cos[start:end], self.sin[start:end], attend, layers)
        cache.length = end
        return out

    @torch.inference_mode()
    def forward_static(self, tokens: torch.Tensor, start: torch.Tensor, cache: StaticKVCache,
                       layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The same forward with every shape fixed by T alone, for CUDA graphs: `start` is a
        [1] tensor (the cache position of tokens[0]), K/V rows are written with index_copy_,
        and attention runs over the whole cache under an additive mask. Does not move
        cache.length (the caller knows it on the host). Slots past the sequence hold stale
        rows, which the mask hides.

        Written for few kernels, since a replayed graph still pays a few microseconds per
        kernel: q/k/v and gate/up are one GEMM each (fused weights, built on first use),
        RoPE runs once over q and k together, the residual adds ride on the GEMMs (addmm),
        and grouped-query attention is baddbmm + softmax + bmm with the mask built once per
        forward instead of once per layer. Same math as the eager path, not the same
        rounding: its logits agree to float tolerance."""
        t = tokens.shape[0]
        slots = start + self.arange[:t]
        visible = self.arange.unsqueeze(0) <= slots.unsqueeze(1)  # [T, max_len]
        return self._static_layers(tokens, slots, slots, visible, cache, layers)

    @torch.inference_mode()
    def forward_masked(self, tokens: torch.Tensor, start: torch.Tensor, pos: torch.Tensor, visible: torch.Tensor,
                       cache: StaticKVCache, layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A block of tokens that is not a chain (a draft tree): row i is written at cache slot
        start+i, rotated to position pos[i], and attends to the cache slots visible[i] [max_len]
        marks. As forward_static, leaves cache.length to the caller."""
        slots = start + self.arange[: tokens.shape[0]]
        return self._static_layers(tokens, slots, pos, visible, cache, layers)

    def _static_layers(self, tokens: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, visible: torch.Tensor,
                       cache: StaticKVCache, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fused decoder stack: rows at cache slots `slots` [T] and positions `pos` [T],
        attending where `visible` [T, max_len] is True."""
        t = tokens.shape[0]
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        group = nh // nkv
        fused = self.fused_layers
        cos = self.cos.index_select(0, pos).unsqueeze(1)  # [T, 1, hd]
        sin = self.sin_signed.index_select(0, pos).unsqueeze(1)
        # Rows ordered (group, token), matching q's layout below.
        bias = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(
            ~visible, float("-inf")).repeat(group, 1)
        h = F.embedding(tokens, self.embed)
        kept: dict[int, torch.Tensor] = {}
        for i, (ln1, wqkv, wo, ln2, wgu, wd) in enumerate(fused):
            qkv = F.linear(F.rms_norm(h, (h.shape[-1],), ln1, self.eps), wqkv).view(t, nh + 2 * nkv, hd)
            qk = qkv[:, : nh + nkv]
            qk = torch.addcmul(qk * cos, qk.roll(hd // 2, -1), sin)  # rotate-half RoPE
            q = qk[:, :nh].reshape(t, nkv, group, hd).permute(1, 2, 0, 3).reshape(nkv, group * t, hd)
            cache.k[i].index_copy_(1, slots, qk[:, nh:].transpose(0, 1))
            cache.v[i].index_copy_(1, slots, qkv[:, nh + nkv:].transpose(0, 1))
            att = torch.baddbmm(bias, q, cache.k[i].transpose(1, 2), alpha=hd ** -0.5).softmax(-1)
            o = torch.bmm(att, cache.v[i]).view(nkv, group, t, hd).permute(2, 0, 1, 3).reshape(t, nh * hd)
            h = torch.addmm(h, o, wo.t())
            gu = F.linear(F.rms_norm(h, (h.shape[-1],), ln2, self.eps), wgu)
            g, u = gu.chunk(2, dim=-1)
            h = torch.addmm(h, F.silu(g) * u, wd.t())
            if i in layers:
                kept[i] = h
        feats = torch.cat([kept[i] for i in layers], dim=-1) if layers else None
        return (F.rms_norm(h, (h.shape[-1],), self.norm, self.eps) @ self.lm_head_t).float(), feats

    @property
    def fused_layers(self) -> list[tuple[torch.Tensor, ...]]:
        """Per layer (ln1, Wqkv, Wo, ln2, W_gate_up, W_down): the static path's fused weights,
        concatenated copies made on first use (the eager path never pays for them)."""
        if self._fused is None:
            self._fused = [(ln1, torch.cat([wq, wk, wv]), wo, ln2, torch.cat([wg, wu]), wd)
                           for ln1, wq, wk, wv, wo, ln2, wg, wu, wd in self.layers]
            half = self.head_dim // 2
            self.sin_signed = torch.cat([-self.sin[:, :half], self.sin[:, half:]], dim=-1)
        return self._fused

    def _layers(self, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend,
                layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder stack; `attend(i, q, k, v)` stores layer i's new K/V and attends."""
        t = tokens.shape[0]
        h = F.embedding(tokens, self.embed)  # [T, D]
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        kept: dict[int, torch.Tensor] = {}
        for i, (ln1, wq, wk, wv, wo, ln2, wg, wu, wd) in enumerate(self.layers):
            x = self._rms(h, ln1)
            q = F.linear(x, wq).view(t, nh, hd).transpose(0, 1)  # [H, T, hd]
            k = F.linear(x, wk).view(t, nkv, hd).transpose(0, 1)
            v = F.linear(x, wv).view(t, nkv, hd).transpose(0, 1)
            attn = attend(i, self._rope(q, cos, sin), self._rope(k, cos, sin), v)
            h = h + F.linear(attn.transpose(0, 1).reshape(t, nh * hd), wo)
            x = self._rms(h, ln2)
            h = h + F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
            if i in layers:
                kept[i] = h
        feats = torch.cat([kept[i] for i in layers], dim=-1) if layers else None
        return (self._rms(h, self.norm) @ self.lm_head_t).float(), feats


class _HFCache:
    def __init__(self):
        from transformers import DynamicCache

        self.kv = DynamicCache()
        self.length = 0

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        if n < self.length:  # negative = tokens to drop; transformers 5.x refuses crop(absolute length)
            self.kv.crop(n - self.length)
        self.length = n


class HFRunner:
    """Any transformers causal LM, through its own forward. Correct, not tuned."""

    def __init__(self, model: Any, max_seq_len: int | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.vocab_size = model.config.vocab_size
        limit = getattr(model.config, "max_position_embeddings", None) or HF_CONTEXT_WITHOUT_LIMIT
        self.max_seq_len = min(max_seq_len or limit, limit)

    def new_cache(self) -> _HFCache:
        return _HFCache()

    @property
    def cache_key(self) -> tuple:
        return ("hf", id(self.model))

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: _HFCache) -> torch.Tensor:
        t = tokens.shape[0]
        if cache.length + t > self.max_seq_len:
            raise ValueError(f"sequence of {cache.length + t} tokens exceeds {self.max_seq_len}")
        pos = torch.arange(cache.length, cache.length + t, device=self.device).unsqueeze(0)
        out = self.model(input_ids=tokens.unsqueeze(0), past_key_values=cache.kv, position_ids=pos, use_cache=True)
        cache.length += t
        return out.logits[0].float()

    @torch.inference_mode()
    def forward_features(self, tokens: torch.Tensor, cache: _HFCache,
                         layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaRunner.forward_features, through HF's hidden_states (entry i+1 is layer i's output)."""
        t = tokens.shape[0]
        if cache.length + t > self.max_seq_len:
            raise ValueError(f"sequence of {cache.length + t} tokens exceeds {self.max_seq_len}")
        pos = torch.arange(cache.length, cache.length + t, device=self.device).unsqueeze(0)
        out = self.model(input_ids=tokens.unsqueeze(0), past_key_values=cache.kv, position_ids=pos, use_cache=True,
                         output_hidden_states=True)
        cache.length += t
        return out.logits[0].float(), torch.cat([out.hidden_states[i + 1][0] for i in layers], dim=-1)


def make_runner(model: Any, max_seq_len: int | None = None) -> Runner:
    """The fast runner for Llama models, the generic one for anything else; a head draft
    (infra/draft_head.py) gets its own runner."""
    if getattr(model, "osd_family", None) == "head":
        from serve.head_runner import HeadRunner

        return HeadRunner(model, max_seq_len)
    if getattr(model.config, "model_type", None) == "llama" and not getattr(model.config, "attention_bias", False):
        return LlamaRunner(model, max_seq_len)
    return HFRunner(model, max_seq_len)
