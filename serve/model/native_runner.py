"""The int4 target's forward in native code (serve/model/native/): one call per step runs
every layer, for the rows of one sequence or of many (a batched step).

`NativeLlamaRunner` is a LlamaRunner (any family it runs) whose eager forwards (decode, verify, prompt chunks of up
to NATIVE_MAX_ROWS rows, and the batched step) go through the library; what it does not cover
(draft trees' masked forwards, CUDA graphs, longer prompts) stays on the PyTorch path it
inherits, over the same caches. Its arithmetic (serve/model/native/gemm.h): the GGUF's Q4_1
weights and a Q8_0 head, activations quantized per row to int8 blocks as llama.cpp does, so
its logits agree with the PyTorch int4 runner to quantization rounding, not bit for bit; a
row's result never depends on the other rows, so a verify equals its decodes exactly.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.nn.functional as F

from serve.model.native_build import load
from serve.model.native_formats import pack_q4, pack_q8
from serve.model.native_tuning import amx_allowed, measure_step, measure_wide, tune
from serve.model.batch_forward import Item, reserve
from serve.model.runner import LlamaRunner, StaticKVCache, _cached, _tensor_key, exact_scales

# Rows up to which a forward takes the native path, faster than PyTorch's int4 at every row
# count measured (`osd bench forward --real`, up to 64 rows; docs/benchmarks.md); longer prompt
# chunks, which the engine does not make (serve.prefill_chunk, 8x that alone), take the
# inherited path.
NATIVE_MAX_ROWS = 512

_P = ctypes.c_void_p
_I = ctypes.c_int32


class OsdLayer(ctypes.Structure):
    _fields_ = [("wqkv", _P), ("wo", _P), ("wgu", _P), ("wd", _P), ("ln1", _P), ("ln2", _P),
                ("bqkv", _P), ("bo", _P), ("q_norm", _P), ("k_norm", _P)]


class OsdModel(ctypes.Structure):
    _fields_ = [("n_layers", _I), ("hidden", _I), ("n_heads", _I), ("n_kv", _I), ("head_dim", _I), ("inter", _I),
                ("vocab", _I), ("max_pos", _I), ("n_tokens", _I), ("eps", ctypes.c_float), ("attn_scale", ctypes.c_float),
                ("layers", _P), ("embed", _P), ("norm", _P), ("head", _P), ("cos", _P), ("sin", _P)]


class OsdSeq(ctypes.Structure):
    _fields_ = [("k", _P), ("v", _P), ("s_layer", ctypes.c_int64), ("s_head", ctypes.c_int64),
                ("s_pos", ctypes.c_int64)]


class OsdBatch(ctypes.Structure):
    _fields_ = [("n_rows", _I), ("tokens", _P), ("pos", _P), ("seq", _P), ("seqs", _P), ("n_logit_rows", _I),
                ("logit_rows", _P), ("logits", _P), ("n_feat_layers", _I), ("feat_layers", _P), ("feats", _P),
                ("n_threads", _I)]


_threads: int | None = None


def forward_threads() -> int:
    """The threads every native forward in this process uses: torch's intra-op count when
    first asked, which is what the process was given (serve.forward_threads on a replica,
    OMP_NUM_THREADS, or the cores); recorded once, because an engine over a native target
    lowers torch's own count to one during its steps (serve/engine/core.py step_threads)."""
    global _threads
    if _threads is None:
        _threads = torch.get_num_threads()
    return _threads


ERRORS = {1: "dimensions the kernels do not tile", 2: "a head layout the kernels do not support",
          3: "a token or position out of range", 4: "a logits row out of range", 5: "a feature layer out of range"}


def native_supported(model: Any) -> str | None:
    """None where the native forward can run `model`, else why not."""
    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return tiles_unsupported(hd, (("hidden_size", cfg.hidden_size), ("intermediate_size", cfg.intermediate_size),
                                  ("attention width", cfg.num_attention_heads * hd)))


def tiles_unsupported(head_dim: int, widths: tuple[tuple[str, int], ...]) -> str | None:
    """None where the kernels tile a layer of this head_dim and these (name, width)s, else why not."""
    if head_dim % 16 or head_dim > 256:
        return f"head_dim {head_dim} (needs a multiple of 16, at most 256)"
    for name, n in widths:
        if n % 32:
            return f"{name} {n} is not a multiple of 32 (the kernels' tiles)"
    return None


def rows_of(caches: list[StaticKVCache], sizes: list[int], bad_cache: str) -> tuple[Any, Any, Any]:
    """The ctypes arrays of a call's rows, `sizes[i]` of them appended to `caches[i]`: each row's
    cache position, its sequence and the sequences' caches (OsdSeq). A cache that is not
    bfloat16 on the CPU with the runner's layout is refused with `bad_cache`."""
    n = sum(sizes)
    # Built from Python ints: a handful of torch ops here (cat, arange, repeat_interleave) cost
    # as much as a tenth of a one-row forward.
    pos = (ctypes.c_int32 * n)(*[p for c, t in zip(caches, sizes) for p in range(c.length, c.length + t)])
    seq = (ctypes.c_int32 * n)(*[i for i, t in enumerate(sizes) for _ in range(t)])
    seqs = (OsdSeq * len(caches))()
    for i, c in enumerate(caches):
        k, v = c.k, c.v
        if k.dtype != torch.bfloat16 or k.device.type != "cpu" or k.stride(-1) != 1 or v.stride() != k.stride():
            raise ValueError(bad_cache)
        seqs[i] = OsdSeq(k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2))
    return pos, seq, seqs


class NativeLlamaRunner(LlamaRunner):
    # Its steps, prompt chunks and batched steps run natively; the PyTorch many-row weights
    # serve only what stays on the inherited path, so they are built when that first runs.
    EAGER_WIDE = False

    def __init__(self, model: Any, max_seq_len: int | None = None, quant: str = "int4",
                 wide_upcast: bool | None = None, lib: ctypes.CDLL | None = None,
                 small_rows: int | None = None):
        if quant != "int4":
            raise ValueError("the native forward serves int4 targets (model.quant int4)")
        why = native_supported(model)
        if why:
            raise ValueError(f"the native forward cannot run this model: {why}")
        # The library first: where it cannot load, make_runner falls back to a LlamaRunner and
        # should not have built this one's PyTorch weights for nothing.
        self.lib = lib if lib is not None else load()
        super().__init__(model, max_seq_len, quant, wide_upcast)
        self.threads = forward_threads()
        # Forwards of at most this many rows run on one thread; None: as measured once the
        # weights are packed (serve/model/native_tuning.py, with whether to prefetch).
        self.small_rows = small_rows
        inner, cfg = model.model, model.config
        self._keep: list[Any] = []  # everything the C structs point into

        def q4(*ws: torch.Tensor) -> torch.Tensor:
            srcs = tuple(w.detach() for w in ws)
            return _cached(("native-q4",) + tuple(_tensor_key(w) for w in srcs), srcs,
                           lambda: pack_q4(torch.cat(srcs) if len(srcs) > 1 else srcs[0], exact_scales(ws)))

        def f32(w: torch.Tensor) -> torch.Tensor:
            out = w.detach().float().contiguous()
            self._keep.append(out)
            return out

        def opt(w: torch.Tensor | None) -> int | None:  # a family's optional vector, or null
            return None if w is None else f32(w).data_ptr()

        layers = (OsdLayer * len(inner.layers))()
        packed = 0
        for i, layer in enumerate(inner.layers):
            at, mlp = layer.self_attn, layer.mlp
            ws = (q4(at.q_proj.weight, at.k_proj.weight, at.v_proj.weight), q4(at.o_proj.weight),
                  q4(mlp.gate_proj.weight, mlp.up_proj.weight), q4(mlp.down_proj.weight))
            self._keep.extend(ws)
            packed += sum(int(w.numel()) for w in ws)
            blk = self.blocks[i]
            layers[i] = OsdLayer(*(w.data_ptr() for w in ws), f32(layer.input_layernorm.weight).data_ptr(),
                                 f32(layer.post_attention_layernorm.weight).data_ptr(), opt(blk.qkv_bias),
                                 opt(blk.o_bias), opt(blk.q_norm), opt(blk.k_norm))
        head_w = model.lm_head.weight.detach()
        # The head in whole tiles of 16 rows: a vocabulary that is not a multiple of 16 gets zero
        # rows, whose logits are computed and dropped.
        self._vocab_rows = -(-cfg.vocab_size // 16) * 16
        pad = (0, 0, 0, self._vocab_rows - cfg.vocab_size)

        def packed_head() -> torch.Tensor:
            scale = exact_scales((model.lm_head.weight,))
            return pack_q8(F.pad(head_w, pad), F.pad(scale[0], pad) if scale else None)

        head = _cached(("native-q8", _tensor_key(head_w)), (head_w,), packed_head)
        # RoPE tables in float32 from the model's own rotary module (its scaling kept).
        with torch.no_grad():
            pos = torch.arange(self.max_seq_len).unsqueeze(0)
            cos, sin = inner.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)
        half = self.head_dim // 2
        cos32 = cos[0].float().contiguous()
        sin32 = torch.cat([-sin[0][:, :half], sin[0][:, half:]], dim=-1).float().contiguous()
        embed = self.embed.contiguous()
        self._keep.extend([layers, head, cos32, sin32, embed])
        # The bytes a one-row forward streams: every packed weight once (osd bench forward's GB/s).
        self.weight_bytes = packed + int(head.numel())
        self._model = OsdModel(len(inner.layers), cfg.hidden_size, self.n_heads, self.n_kv, self.head_dim,
                               cfg.intermediate_size, self._vocab_rows, self.max_seq_len, cfg.vocab_size, float(self.eps),
                               float(self.head_dim ** -0.5), ctypes.addressof(layers), embed.data_ptr(),
                               f32(self.norm).data_ptr(), head.data_ptr(), cos32.data_ptr(), sin32.data_ptr())
        key = (self.weight_bytes, self.threads, id(self.lib))
        wide = measure_wide(self, self.threads) if amx_allowed() and self.lib.osd_set_amx(0) else None
        self.tuning = tune(key, self.weight_bytes, self.threads, measure_step(self), wide)
        if self.tuning.ms:  # measured here: the library's settings are process-wide, defaults stay
            self.lib.osd_set_prefetch(int(self.tuning.prefetch))
            self.lib.osd_set_amx(self.tuning.amx_rows)
        if self.small_rows is None:
            self.small_rows = self.tuning.small_rows

    def _run(self, tokens: torch.Tensor, cache: StaticKVCache, layers: tuple[int, ...],
             logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if tokens.shape[0] > NATIVE_MAX_ROWS:
            return super()._run(tokens, cache, layers, logits)
        return self.forward_rows([Item(tokens, cache, logits)], layers)[0]

    def forward_rows(self, items: list[Item], layers: tuple[int, ...] = ()) -> list[tuple]:
        """Every item's rows in one native forward: per item (logits [T, V] float32 or None,
        features of `layers` [T, len(layers) * D] in the model's dtype, or None)."""
        n = sum(it.tokens.shape[0] for it in items)
        return self.forward_rows_on(items, layers, 1 if n <= self.small_rows else self.threads)

    @torch.inference_mode()
    def forward_rows_on(self, items: list[Item], layers: tuple[int, ...] = (), threads: int = 1) -> list[tuple]:
        """forward_rows on `threads` threads."""
        if any(it.visible is not None for it in items):
            raise ValueError("the native forward runs chains and prompt chunks, not draft trees' masked blocks")
        sizes = [it.tokens.shape[0] for it in items]
        reserve(items, sizes)
        n = sum(sizes)
        tokens = (items[0].tokens if len(items) == 1 else torch.cat([it.tokens.reshape(-1) for it in items]))
        tokens = tokens.reshape(-1).to(torch.int64).contiguous()
        pos, seq, seqs = rows_of([it.cache for it in items], sizes,
                                 "the native forward needs this runner's own caches (bfloat16 on the CPU)")
        offsets = [0]
        for t in sizes:
            offsets.append(offsets[-1] + t)
        wanted = [r for i, it in enumerate(items) if it.logits for r in range(offsets[i], offsets[i + 1])]
        rows = (ctypes.c_int32 * len(wanted))(*wanted)
        out = torch.empty(len(wanted), self._vocab_rows, dtype=torch.float32)
        feat_layers = (ctypes.c_int32 * len(layers))(*layers)
        feats = torch.empty(n, len(layers) * self.hidden[0], dtype=torch.bfloat16) if layers else None
        batch = OsdBatch(n, tokens.data_ptr(), ctypes.addressof(pos), ctypes.addressof(seq), ctypes.addressof(seqs),
                         len(wanted), ctypes.addressof(rows), out.data_ptr(), len(layers),
                         ctypes.addressof(feat_layers), feats.data_ptr() if feats is not None else None, threads)
        err = self.lib.osd_forward(ctypes.byref(self._model), ctypes.byref(batch))
        if err:
            raise ValueError(f"native forward refused its input: {ERRORS.get(err, err)}")
        for it, t in zip(items, sizes):
            it.cache.length += t
        if self._vocab_rows != self.vocab_size:
            out = out[:, :self.vocab_size].contiguous()
        results, lo = [], 0
        for i, it in enumerate(items):
            lg = None
            if it.logits:
                lg, lo = out[lo:lo + sizes[i]], lo + sizes[i]
            ft = feats[offsets[i]:offsets[i + 1]].to(self.dtype) if feats is not None else None
            results.append((lg, ft))
        return results
