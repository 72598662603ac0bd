"""The GPU path: fixed-shape forwards replayed as CUDA graphs, and host-to-device copies
that never wait for the GPU.

Why graphs. SmolLM2-135M is 30 small layers: an eager step is over a thousand kernel
launches while its weights stream in a fraction of a millisecond, so the step is
launch-bound (docs/benchmarks.md, "On a GPU").
A captured graph replays all of them with one launch.

Why torch.cuda.CUDAGraph directly rather than torch.compile(mode="reduce-overhead"):
the engine's shapes are few and known (one per token count T), the static buffers that
matter are the per-request KV caches the engine already owns, and capture costs
milliseconds where compile costs minutes per shape, on every replica start. Nothing here
needs a compiler; graphs keyed by (cache, T) say exactly what is captured.

Batched steps (serve/model/batch_forward.py pooled): one graph per bucket of (rows, grid
lines, grid width, attended span) of the pool forward (serve/model/pool_forward.py), as vLLM captures a
graph per batch size; the rows are padded to the bucket. The rows' values, slots and
positions are the graph's inputs; the pool is its cache.

A request slot's own forwards (decode, verify) take the same pool graphs, as a batch of one,
so no graph is captured per slot. Caches outside a pool (draft scratch, tests) keep graphs of
their own:

Shapes. Each runner forward of T tokens (T <= max_graph_tokens, which the engine sets to
k+1) is one graph per (cache, T, feature layers), captured on first use: decode (T=1), verify (T = drafts+1,
so the draft-length policy and the budget clamp use the sizes they need, each captured once),
and each draft step. Longer forwards (prefill) run eagerly over the same cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from serve.model.pool_forward import PoolRows, pool_forward, pool_rows, run_rows
from serve.model.runner import KVPool, LlamaRunner, StaticKVCache

# Forwards of more tokens than this (prefill) run eagerly: a graph per prompt length
# would be captured once and never replayed.
MAX_GRAPH_TOKENS = 64
# Pool forwards of more rows than this (a bucket) run eagerly.
MAX_GRAPH_ROWS = 256


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    inputs: tuple[torch.Tensor, ...]
    outputs: Any
    cache: Any  # held so its memory, which the graph writes, is never freed and reused


class GraphSet:
    """CUDA graphs of `fn(cache, *inputs)`, one per key, sharing one memory pool.

    Capture never touches the real cache's contents: the warm-up before capture (cuBLAS
    and allocator set-up must not happen inside it) runs on a scratch cache of the same
    shape, and capture itself executes nothing."""

    def __init__(self, new_cache: Callable[[], Any]):
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[Any, _Captured] = {}
        self._new_cache = new_cache
        self._scratch: Any = None

    def run(self, key: Any, fn: Callable[..., Any], cache: Any, inputs: Sequence[torch.Tensor],
            warm_on: Any = None) -> Any:
        """Replay key's graph (captured on first use) over `inputs`. warm_on: what the warm-up
        runs over instead of a scratch cache, for a forward whose writes are idempotent (the
        pool forward writes each row's K/V where the replay writes the same values)."""
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(fn, cache, inputs, warm_on)
        for buf, x in zip(entry.inputs, inputs):
            buf.copy_(x)
        entry.graph.replay()
        return entry.outputs

    def _capture(self, fn: Callable[..., Any], cache: Any, inputs: Sequence[torch.Tensor],
                 warm_on: Any = None) -> _Captured:
        static = tuple(x.clone() for x in inputs)
        if warm_on is None and self._scratch is None:
            self._scratch = self._new_cache()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn(self._scratch if warm_on is None else warm_on, *static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn(cache, *static)
        return _Captured(graph, static, outputs, cache)


class GraphLlamaRunner(LlamaRunner):
    """LlamaRunner whose short forwards replay CUDA graphs (same weights, same cache layout,
    so eager prefill and graph steps share a cache). Outputs are cloned: a graph's output
    buffers are overwritten by its next replay."""

    max_graph_tokens = MAX_GRAPH_TOKENS

    def __init__(self, model: Any, max_seq_len: int | None = None):
        super().__init__(model, max_seq_len)
        if self.device.type != "cuda":
            raise ValueError("GraphLlamaRunner needs a CUDA model")
        self.graphs = GraphSet(self.new_cache)

    @property
    def cache_key(self) -> tuple:
        return ("graph",) + super().cache_key[1:]

    def _run(self, tokens: torch.Tensor, cache: StaticKVCache, layers: tuple[int, ...],
             logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        t = tokens.shape[0]
        if t > self.max_graph_tokens:
            return super()._run(tokens, cache, layers, logits)
        start = cache.length
        if start + t > cache.max_len:
            raise ValueError(f"sequence of {start + t} tokens exceeds the cache's {cache.max_len}")
        if cache.pool is not None:  # a request slot: the pool forward's graphs, shared by every slot
            out, feats = self.forward_pool(cache.pool, pool_rows(cache.pool, [tokens], [cache], self.device), layers)
            cache.length = start + t
            return out[:t], (feats[:t] if feats is not None else None)
        begin = self.arange[start: start + 1]  # a device tensor made without a host copy

        def step(c: StaticKVCache, toks: torch.Tensor, at: torch.Tensor):
            return self.forward_static(toks, at, c, layers)

        logits, feats = self.graphs.run((id(cache), t, layers), step, cache, (tokens, begin))
        cache.length = start + t
        return logits.clone(), (feats.clone() if feats is not None else None)

    def forward_pool(self, pool: KVPool, rows: PoolRows,
                     layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pool forward (serve/model/pool_forward.py), a graph per bucket of its shapes."""
        if rows.tokens.shape[0] > MAX_GRAPH_ROWS:
            return run_rows(self, pool, rows, layers)
        width, span = rows.width, rows.span

        def step(p: KVPool, *inputs: torch.Tensor):
            return pool_forward(self, p, *inputs, width, span, layers)

        logits, feats = self.graphs.run((id(pool), "pool", rows.key, layers), step, pool, rows.inputs, warm_on=pool)
        return logits.clone(), (feats.clone() if feats is not None else None)

    def forward_masked(self, tokens: torch.Tensor, start: torch.Tensor, pos: torch.Tensor, visible: torch.Tensor,
                       cache: StaticKVCache, layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """LlamaRunner.forward_masked (a tree block) as a graph per (cache, T)."""
        if tokens.shape[0] > self.max_graph_tokens:
            return super().forward_masked(tokens, start, pos, visible, cache, layers)

        def block(c: StaticKVCache, toks, at, p, vis):
            return LlamaRunner.forward_masked(self, toks, at, p, vis, c, layers)

        logits, feats = self.graphs.run((id(cache), tokens.shape[0], "masked", layers), block, cache,
                                        (tokens, start, pos, visible))
        return logits.clone(), (feats.clone() if feats is not None else None)


class StagingRing:
    """Host ints to the GPU without a stream sync: a blocking copy from pageable memory
    waits for the GPU to drain, so values go through a pinned buffer with non_blocking
    copies. Slots are reused only after `reset()`, which the engine calls once per step,
    after the step's one sync (by then every earlier copy has landed)."""

    def __init__(self, device: torch.device, size: int = 1 << 16):
        self.device = device
        self.buf = torch.empty(size, dtype=torch.long, pin_memory=True)
        self.at = 0

    def to_device(self, values: Sequence[int]) -> torch.Tensor:
        n = len(values)
        if self.at + n > self.buf.numel():
            # More than a step's worth: fall back to a plain (syncing) copy rather than
            # overwrite a slot whose copy may still be in flight.
            return torch.tensor(list(values), dtype=torch.long, device=self.device)
        view = self.buf[self.at: self.at + n]
        view.copy_(torch.as_tensor(values, dtype=torch.long))
        self.at += n
        return view.to(self.device, non_blocking=True)

    def reset(self) -> None:
        self.at = 0
