"""Model runners: one forward over new tokens against a preallocated KV cache.

`LlamaRunner` is a lean re-implementation of the Llama forward over a Hugging Face model's
weights (q|k|v and gate|up fused into one GEMM each), for Llama and the families that differ
from it in a few facts (Mistral, Qwen2, Qwen3: serve/model/families.py). It exists
because the per-op Python and allocation work inside HF's generic forward is a large
share of a 135M model's step on CPU. Same math as HF (RMSNorm, rotate-half RoPE, SDPA),
so logits match HF to float rounding.

`HFRunner` wraps any other causal LM through its own forward and DynamicCache, so the
engine accepts any pair of causal LMs that share a vocab; it is slower.

Both expose: new_cache(), forward(tokens [T], cache) -> logits [T, V] (appending T
positions to the cache), cache.truncate(n) for rollback, and cache_key.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from infra.common.cpu import native_bf16_gemm
from infra.formats.quant_codes import EXACT_SCALES, int4_codes
from serve.model.linear import QUANT_MODES, Dense, Int4, Int8, Upcast, make_linear
from serve.model.families import Family, lean_family


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

    def prefill(self, tokens: torch.Tensor, cache: Any, layers: tuple[int, ...] = ()) -> torch.Tensor | None:
        """Append tokens without computing logits; returns the features of `layers` (or None)."""
        ...


class StaticKVCache:
    """Preallocated keys/values for one sequence: [layers, kv_heads, max_len, head_dim].

    Rollback is O(1): only `length` moves; stale slots past it are overwritten later. A cache
    in a KVPool is a view of one of its slots, whose positions may grow (reserve) up to max_len.
    """

    def __init__(self, layers: int, kv_heads: int, max_len: int, head_dim: int, dtype, device,
                 pool: "KVPool | None" = None, index: int = 0):
        if pool is None:
            shape = (layers, kv_heads, max_len, head_dim)
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        else:
            self.k, self.v = pool.k[:, index], pool.v[:, index]
        self.pool = pool
        self.index = index
        self.length = 0
        self.max_len = max_len

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.length = n

    def reserve(self, n: int) -> None:
        """Room for n positions (a pooled cache's slot grows; others have it from the start)."""
        if self.pool is not None and n > self.pool.capacity:
            self.pool.grow(n)

    def take_prefix(self, source: "StaticKVCache", n: int) -> None:
        """Hold `source`'s first n positions (serve/engine/prefix.py): copied, unless `source` is
        this cache, whose positions are still there past its length."""
        if n > source.max_len or n > self.max_len:
            raise ValueError(f"cannot take {n} positions of a cache of {source.max_len}")
        if source is not self:
            self.reserve(n)
            with torch.inference_mode():  # the forwards' own mode, whatever made the tensors
                self.k[:, :, :n].copy_(source.k[:, :, :n])
                self.v[:, :, :n].copy_(source.v[:, :, :n])
        self.length = n


class KVPool:
    """The caches of several sequences in one tensor each for keys and values, [layers, slots,
    kv_heads, capacity, head_dim], so a batched forward attends for all its one-row sequences
    at once (serve/model/batch_forward.py) instead of one call each. Growable pools start with a
    small capacity and double it as sequences need (up to max_len, all slots copied once):
    the batched attention then runs over whole, contiguous slot rows (bmm would otherwise
    copy every slot's prefix each layer); a fixed pool (CUDA graphs, draft trees, which
    address every position of max_len) has max_len from the start.

    One slot more than the sequences' is the spare: no sequence owns it, and a forward padded
    to a fixed shape (serve/model/pool_forward.py) writes its padding rows there."""

    MIN_CAPACITY = 256

    def __init__(self, slots: int, layers: int, kv_heads: int, max_len: int, head_dim: int, dtype, device,
                 growable: bool = False):
        self.max_len = max_len
        self.capacity = min(self.MIN_CAPACITY, max_len) if growable else max_len
        self.spare = slots
        shape = (layers, slots + 1, kv_heads, self.capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.caches = [StaticKVCache(layers, kv_heads, max_len, head_dim, dtype, device, self, i)
                       for i in range(slots)]

    def grow(self, n: int) -> None:
        if n > self.max_len:
            raise ValueError(f"sequence of {n} tokens exceeds the cache's {self.max_len}")
        cap = self.capacity
        while cap < n:
            cap *= 2
        cap = min(cap, self.max_len)
        old_k, old_v = self.k, self.v
        shape = old_k.shape[:3] + (cap,) + old_k.shape[4:]
        self.k = old_k.new_zeros(shape)
        self.v = old_v.new_zeros(shape)
        self.k[:, :, :, :self.capacity] = old_k
        self.v[:, :, :, :self.capacity] = old_v
        self.capacity = cap
        for c in self.caches:
            c.k, c.v = self.k[:, c.index], self.v[:, c.index]


# Context bound of an HFRunner whose model config declares no max_position_embeddings (a
# model with no position limit of its own); the engine's max_seq_len still applies below it.
HF_CONTEXT_WITHOUT_LIMIT = 4096

_HEAD_T: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_FUSED: dict[tuple, tuple[tuple[torch.Tensor, ...], Any]] = {}
_FUSED_MAX = 512  # entries (one per weight group of a layer): a target and a few drafts


def _tensor_key(w: torch.Tensor) -> tuple:
    return (w.data_ptr(), tuple(w.shape), w.dtype, str(w.device), w._version)


def _transposed_head(weight: torch.Tensor) -> torch.Tensor:
    """The [D, V] head copy, shared by every runner over the same head tensor: drafts that
    share the target's frozen head (every registry version) would otherwise copy 113 MB each."""
    w = weight.detach()
    key = _tensor_key(w)
    if key not in _HEAD_T:
        while len(_HEAD_T) >= 4:
            _HEAD_T.pop(next(iter(_HEAD_T)))
        # Holding the source keeps its memory from being reused, so a data_ptr key stays unique.
        _HEAD_T[key] = (w, w.t().contiguous())
    return _HEAD_T[key][1]


def _cached(key: tuple, sources: tuple[torch.Tensor, ...], make: Callable[[], Any]) -> Any:
    """make() once per key in a bounded, least-recently-used cache that holds `sources`, so a
    data_ptr in the key is never reused by other tensors while the entry lives."""
    hit = _FUSED.pop(key, None)
    if hit is None:
        while len(_FUSED) >= _FUSED_MAX:
            _FUSED.pop(next(iter(_FUSED)))
        hit = (sources, make())
    _FUSED[key] = hit  # most recently used last
    return hit[1]


def shared_linear(sources: tuple[torch.Tensor, ...], quant: str, dtype: torch.dtype) -> Dense | Int4:
    """One linear over the concatenated `sources` (q|k|v, gate|up, or a single weight), made
    once per set of tensors: a `truncate:L` draft shares the target's layers, and the bench's
    several engines over one model would otherwise each hold a copy."""
    srcs = tuple(w.detach() for w in sources)
    return _cached((quant, dtype) + tuple(_tensor_key(w) for w in srcs), srcs,
                   lambda: make_linear(srcs[0] if len(srcs) == 1 else torch.cat(srcs), quant, dtype,
                                       exact_scales(sources) if quant == "int4" else None))


def exact_scales(sources: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
    """The block scales the loader kept on `sources` (infra/formats/quant_codes.py), concatenated as the
    weights are; None where none has them. In a fused weight whose parts the file kept in
    different types (Q4_K_M's q and k in Q4_K, v in Q6_K), a part without them takes its own
    min/max scales, so the others stay exact."""
    kept = [getattr(w, EXACT_SCALES, None) for w in sources]
    if all(k is None for k in kept):
        return None
    kept = [k if k is not None else int4_codes(w)[1:] for k, w in zip(kept, sources)]
    return tuple(torch.cat([p.float() for p in parts]) for parts in zip(*kept))


# Blocks of up to this many rows (decode, verify, draft trees) attend row by row in the same
# arithmetic as one row; longer ones (prefill) take the fused kernel.
ROW_EXACT_MAX_T = 16


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              gqa: bool) -> torch.Tensor:
    """q [T, H, hd] against k/v [KV, L, hd] -> [T, H*hd].

    Up to ROW_EXACT_MAX_T rows: scores by bmm in the cache's dtype, softmax in float32, then a
    bmm with V (HF's eager attention, per row). Every op there computes a row the same way
    whatever the other rows are, so on the CPU an int4 target's verify forward of T rows gives
    bitwise the logits of T one-row decode forwards, and its speculation emits exactly what it
    decodes alone (measured op by op: the int4/int8 kernels, rms_norm and softmax are
    row-independent; float32 bmm, addmm and the fused attention kernel are not; oneDNN's
    dense bf16 GEMM mostly is, but not always on the real model, where dense bfloat16
    speculation then differs from its AR at near ties only).
    One row this way is also faster than the fused kernel in bfloat16 (docs/benchmarks.md,
    "Figures behind code choices"). Longer blocks: 4-D SDPA, grouped-query heads without
    copies, which reaches the fused CPU attention kernel."""
    t, nh, hd = q.shape
    if t <= ROW_EXACT_MAX_T:
        nkv = k.shape[0]
        group = nh // nkv
        qg = q.reshape(t, nkv, group, hd).permute(1, 2, 0, 3).reshape(nkv, group * t, hd)
        scores = torch.bmm(qg, k.transpose(1, 2)).float().mul_(hd ** -0.5)
        if mask is not None:
            scores = scores.view(nkv, group, t, -1).masked_fill_(~mask, float("-inf")).view(nkv, group * t, -1)
        probs = scores.softmax(-1).to(v.dtype)
        if mask is not None and v.dtype == torch.bfloat16 and not native_bf16_gemm():
            return _rowwise_pv(probs.view(nkv, group, t, -1), v, mask).reshape(t, nh * hd)
        out = torch.bmm(probs, v)
        return out.view(nkv, group, t, hd).permute(2, 0, 1, 3).reshape(t, nh * hd)
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                       attn_mask=mask, enable_gqa=gqa)
    return o[0].transpose(0, 1).reshape(t, nh * hd)


def _rowwise_pv(probs: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """probs [KV, G, T, L] times v [KV, L, hd], each row summed over its own visible prefix
    only -> [T, KV, G, hd]. Where bfloat16 GEMMs are emulated (AVX2: infra/common/cpu.py) one bmm
    over the block's full length, masked zeros included, now and then rounds a row otherwise
    than the decode's bmm over that row's prefix (3 of 16 real 5-row verify blocks differed at
    some layer on 2 Zen 3 cores), so there each row takes a decode's exact shapes: [KV, G, L_j]."""
    # Up to each row's last visible column: its prefix for a chain, its deepest ancestor for a
    # draft tree's node (the masked columns before it hold zeros of the softmax).
    lengths = (mask.shape[-1] - mask.flip(-1).int().argmax(-1)).tolist()
    return torch.stack([torch.bmm(probs[:, :, j, :n], v[:, :n]) for j, n in enumerate(lengths)])


def _shared_head(weight: torch.Tensor, quant: str, dtype: torch.dtype) -> Dense | Int8 | Upcast:
    w = weight.detach()
    return _cached(("head", quant, dtype, _tensor_key(w)), (w,), lambda: make_linear(w, quant, dtype))


def wide_format(dtype: torch.dtype, upcast: bool | None = None) -> str:
    """How a runner keeps its wide weights (prompts, batched steps of many rows): "none", the
    model's own weights, or "upcast", float32 copies under its lower-precision activations,
    where this CPU has no native bfloat16 GEMM (infra/common/cpu.py). upcast:
    force either way (tests); None: decide by dtype and CPU."""
    if upcast is None:
        upcast = dtype != torch.float32 and not native_bf16_gemm()
    return "upcast" if upcast else "none"


def prefix_attend(cache: StaticKVCache, start: int, end: int, mask: torch.Tensor | None, gqa: bool):
    """decoder_layer's `attend` for rows at cache slots start..end: write layer i's new K/V
    there and attend over the filled prefix [:end]."""
    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache.k[i, :, start:end] = k.transpose(0, 1)
        cache.v[i, :, start:end] = v.transpose(0, 1)
        return attention(q, cache.k[i, :, :end], cache.v[i, :, :end], mask, gqa)

    return attend


class Block(NamedTuple):
    """One decoder layer's weights as the lean forward multiplies them; the optional ones are
    what a family adds to Llama's (serve/model/families.py)."""
    ln1: torch.Tensor
    qkv: Any  # q|k|v fused (serve/model/linear.py)
    o: Any
    ln2: torch.Tensor
    gu: Any  # gate|up fused
    down: Any
    qkv_bias: torch.Tensor | None = None  # [(H + 2 KV) * hd]
    o_bias: torch.Tensor | None = None  # [D]
    q_norm: torch.Tensor | None = None  # [hd], per head
    k_norm: torch.Tensor | None = None


def decoder_layer(h: torch.Tensor, block: Block, cos: torch.Tensor, sin: torch.Tensor, attend, i: int,
                  n_heads: int, n_kv: int, head_dim: int, eps: float) -> torch.Tensor:
    """One decoder layer over T rows h [T, D]: the target's stack and the head draft's single
    layer both run it. cos/sin [T, 1, hd], sin with its first half negated; `attend(i, q, k,
    v)` stores the layer's new K/V and returns its attention output [T, H*hd]. Every op is
    row by row, so a row's result does not depend on the others."""
    t, hidden = h.shape[0], (h.shape[-1],)
    qkv = block.qkv(F.rms_norm(h, hidden, block.ln1, eps))
    if block.qkv_bias is not None:
        qkv = qkv + block.qkv_bias
    qkv = qkv.view(t, n_heads + 2 * n_kv, head_dim)
    qk = qkv[:, : n_heads + n_kv]
    if block.q_norm is not None:
        qk = torch.cat([F.rms_norm(qk[:, :n_heads], (head_dim,), block.q_norm, eps),
                        F.rms_norm(qk[:, n_heads:], (head_dim,), block.k_norm, eps)], dim=1)
    qk = torch.addcmul(qk * cos, qk.roll(head_dim // 2, -1), sin)  # rotate-half RoPE, q and k at once
    att = attend(i, qk[:, :n_heads], qk[:, n_heads:], qkv[:, n_heads + n_kv:])
    h = block.o.add(h, att) if block.o_bias is None else h + (block.o(att) + block.o_bias)
    g, u = block.gu(F.rms_norm(h, hidden, block.ln2, eps)).chunk(2, dim=-1)
    return block.down.add(h, F.silu(g).mul_(u))


class LlamaRunner:
    """The lean Llama forward: per layer one GEMM for q|k|v and one for gate|up, fused
    RMSNorm, RoPE on q and k together without concatenation, one attention call, the
    residual adds on the GEMMs. The eager path (CPU, prefill on GPU) attends over the
    cache's filled prefix; forward_static/forward_masked (CUDA graphs, draft trees) over
    the whole cache under a mask. Both run the same decoder stack (`_decoder`).

    quant: "none" keeps the model's weights (fused copies of q|k|v and gate|up);
    "int4" multiplies every decoder linear by group-wise int4 weights (serve/model/linear.py),
    the GGUF target's own Q4_1 weights. The head and embedding stay in the model's dtype."""

    # Build the many-row weights (prefill_blocks, wide_head) with the runner; a runner whose
    # forwards seldom need them (the native one) builds them on first use instead.
    EAGER_WIDE = True

    def __init__(self, model: Any, max_seq_len: int | None = None, quant: str = "none",
                 wide_upcast: bool | None = None):
        cfg = model.config
        self.family: Family = lean_family(model)
        if quant not in QUANT_MODES:
            raise ValueError(f"unknown quant {quant!r}: expected one of {', '.join(QUANT_MODES)}")
        if quant == "int4" and (model.lm_head.weight.dtype != torch.bfloat16 or model.lm_head.weight.device.type != "cpu"):
            raise ValueError("quant int4 needs a bfloat16 model on the CPU (its kernel's activation dtype)")
        inner = model.model
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.vocab_size = cfg.vocab_size
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden = (cfg.hidden_size,)
        self.eps = cfg.rms_norm_eps
        self.max_seq_len = self.family.context(min(max_seq_len or cfg.max_position_embeddings,
                                                   cfg.max_position_embeddings))
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.head = self._make_head(model.lm_head.weight, quant)
        self._quant, self._layers, self._lm_head_weight = quant, inner.layers, model.lm_head.weight
        # Many rows at once (prompts, batched steps): the model's own weights, fused, where int4
        # is slower there. oneDNN's bf16 GEMM reuses each weight across rows, the int4/int8
        # kernels cost about as much per row at any count (docs/benchmarks.md, "Rows against
        # weight formats"). Where the CPU has no native bfloat16 GEMM they are float32
        # (wide_format), since emulated bfloat16 is slower still.
        self._wide = wide_format(self.dtype, wide_upcast if self.device.type == "cpu" else False)
        self.blocks = self._stack(quant)
        if self.EAGER_WIDE:  # built now, so no request's first long forward waits for them
            self.prefill_blocks, self.wide_head  # noqa: B018 (cached_property)
        # RoPE tables from the model's own rotary module, so any rope scaling it applies is kept.
        with torch.no_grad():
            pos = torch.arange(self.max_seq_len, device=self.device).unsqueeze(0)
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = inner.rotary_emb(probe, pos)
        half = self.head_dim // 2
        # [max_seq_len, 1, head_dim]; sin with the first half negated, so rotate-half is a roll.
        self.cos = cos[0].unsqueeze(1)
        self.sin_signed = torch.cat([-sin[0][:, :half], sin[0][:, half:]], dim=-1).unsqueeze(1)
        self.causal = torch.ones(self.max_seq_len, self.max_seq_len, dtype=torch.bool, device=self.device).tril()
        self.arange = torch.arange(self.max_seq_len, device=self.device)

    def _stack(self, q: str) -> list[Block]:
        """Per layer its Block, with the weights in format q."""
        def linear(*ws: torch.Tensor) -> Dense | Int4:
            return shared_linear(ws, q, self.dtype)

        return [_block(layer, linear, self.family) for layer in self._layers]

    @functools.cached_property
    def prefill_blocks(self) -> list[Block]:
        """The decoder's blocks for forwards of many rows (format `_wide`)."""
        return self.blocks if self._quant == self._wide == "none" else self._stack(self._wide)

    @functools.cached_property
    def wide_head(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The LM head for many rows (format `_wide`)."""
        if self._quant == self._wide == "none":
            return self.head
        return _shared_head(self._lm_head_weight, self._wide, self.dtype)

    def _make_head(self, weight: torch.Tensor, quant: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """The output projection, a fifth of a 135M model's bytes per step. float32: a [D, V]
        copy, which MKL's small-M GEMM reads faster; bfloat16: the weight as it is, which
        oneDNN reads faster than that copy; int4 targets: int8 rows, the fastest of the three,
        as the GGUF keeps the tied head in 8 bits (docs/benchmarks.md)."""
        if quant == "int4":
            return _shared_head(weight, "int8", self.dtype)
        if self.dtype == torch.float32:
            head_t = _transposed_head(weight)
            return lambda x: x @ head_t
        return _shared_head(weight, "none", self.dtype)

    def new_cache(self) -> StaticKVCache:
        return StaticKVCache(len(self.blocks), self.n_kv, self.max_seq_len, self.head_dim, self.dtype, self.device)

    def new_caches(self, n: int, growable: bool = False) -> list[StaticKVCache]:
        """n caches in one pool (KVPool): the engine's request slots."""
        return KVPool(n, len(self.blocks), self.n_kv, self.max_seq_len, self.head_dim, self.dtype,
                      self.device, growable).caches

    @property
    def cache_key(self) -> tuple:
        """Runners with equal keys can share caches (drafts of one family swap without new memory)."""
        return ("static", len(self.blocks), self.n_kv, self.max_seq_len, self.head_dim, self.dtype, str(self.device))

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

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, cache: StaticKVCache,
                layers: tuple[int, ...] = ()) -> torch.Tensor | None:
        """Append a prompt's tokens to the cache; returns the features of `layers` (None for
        none) and no logits: the engine never reads a prefill's, and an output projection over
        every prompt row costs as much as a decoder layer. Long blocks of an int4 target take
        the model's own bfloat16 weights (GEMMs that many rows are compute-bound, where
        oneDNN's bf16 kernel is faster than int4's; docs/benchmarks.md)."""
        return self._run(tokens, cache, layers, logits=False)[1]

    def _run(self, tokens: torch.Tensor, cache: StaticKVCache, layers: tuple[int, ...],
             logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        t = tokens.shape[0]
        start = cache.length
        end = start + t
        if end > cache.max_len:
            raise ValueError(f"sequence of {end} tokens exceeds the cache's {cache.max_len}")
        cache.reserve(end)
        # One query block attends to everything cached plus itself, causally; one mask per forward.
        mask = None if t == 1 else self.causal[start:end, :end]

        attend = prefix_attend(cache, start, end, mask, self.n_kv != self.n_heads)
        blocks = self.prefill_blocks if t > ROW_EXACT_MAX_T else self.blocks
        out = self._decoder(tokens, self.cos[start:end], self.sin_signed[start:end], attend, layers, blocks, logits)
        cache.length = end
        return out

    @torch.inference_mode()
    def forward_static(self, tokens: torch.Tensor, start: torch.Tensor, cache: StaticKVCache,
                       layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The same forward with every shape fixed by T alone, for CUDA graphs: `start` is a
        [1] tensor (the cache position of tokens[0]), K/V rows are written with index_copy_,
        and attention runs over the whole cache under an additive mask. Does not move
        cache.length (the caller knows it on the host). Slots past the sequence hold stale
        rows, which the mask hides. Same math as the eager path, not the same rounding:
        its logits agree to float tolerance."""
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
        """Rows at cache slots `slots` [T] and positions `pos` [T], attending where `visible`
        [T, max_len] is True: grouped-query attention as baddbmm + softmax + bmm over the
        whole cache, the additive mask built once per forward instead of once per layer."""
        t = tokens.shape[0]
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        group = nh // nkv
        # Rows ordered (group, token), matching q's layout below.
        bias = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(
            ~visible, float("-inf")).repeat(group, 1)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.k[i].index_copy_(1, slots, k.transpose(0, 1))
            cache.v[i].index_copy_(1, slots, v.transpose(0, 1))
            qg = q.reshape(t, nkv, group, hd).permute(1, 2, 0, 3).reshape(nkv, group * t, hd)
            att = torch.baddbmm(bias, qg, cache.k[i].transpose(1, 2), alpha=hd ** -0.5).softmax(-1)
            return torch.bmm(att, cache.v[i]).view(nkv, group, t, hd).permute(2, 0, 1, 3).reshape(t, nh * hd)

        return self._decoder(tokens, self.cos.index_select(0, pos), self.sin_signed.index_select(0, pos),
                             attend, layers)

    def _decoder(self, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend,
                 layers: tuple[int, ...], blocks: list | None = None,
                 logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The decoder stack over T rows (cos/sin [T, 1, hd]); `attend(i, q, k, v)` stores layer
        i's new K/V and returns its attention output [T, H*hd]. Returns (logits [T, V] float32
        or None when not asked for, the features of `layers` or None)."""
        h, feats = self.stack(tokens, cos, sin, attend, layers, blocks)
        if not logits:
            return None, feats
        return self.head(F.rms_norm(h, self.hidden, self.norm, self.eps)).float(), feats

    def stack(self, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend,
              layers: tuple[int, ...], blocks: list | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder layers alone: (the last layer's output [T, D], the features of `layers`)."""
        h = F.embedding(tokens, self.embed)  # [T, D]
        kept: dict[int, torch.Tensor] = {}
        for i, block in enumerate(self.blocks if blocks is None else blocks):
            h = decoder_layer(h, block, cos, sin, attend, i, self.n_heads, self.n_kv, self.head_dim, self.eps)
            if i in layers:
                kept[i] = h
        return h, torch.cat([kept[i] for i in layers], dim=-1) if layers else None


def _block(layer: Any, linear: Callable[..., Any], family: Family) -> Block:
    """A Hugging Face decoder layer's weights as a Block (linear fuses and formats them)."""
    at, mlp = layer.self_attn, layer.mlp
    qkv_bias = torch.cat([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias]).detach() if family.qkv_bias else None
    return Block(layer.input_layernorm.weight, linear(at.q_proj.weight, at.k_proj.weight, at.v_proj.weight),
                 linear(at.o_proj.weight), layer.post_attention_layernorm.weight,
                 linear(mlp.gate_proj.weight, mlp.up_proj.weight), linear(mlp.down_proj.weight),
                 qkv_bias=qkv_bias, o_bias=at.o_proj.bias.detach() if family.o_bias else None,
                 q_norm=at.q_norm.weight if family.qk_norm else None,
                 k_norm=at.k_norm.weight if family.qk_norm else None)


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

    def new_caches(self, n: int, growable: bool = False) -> list[_HFCache]:
        return [_HFCache() for _ in range(n)]

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

    def prefill(self, tokens: torch.Tensor, cache: _HFCache, layers: tuple[int, ...] = ()) -> torch.Tensor | None:
        if layers:
            return self.forward_features(tokens, cache, layers)[1]
        self.forward(tokens, cache)
        return None

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
