"""`osd bench forward`: what one target forward of T tokens costs, eager and as a CUDA graph.

The question it answers is the one trees and k depend on: how the verify forward's time
grows with the number of tokens it scores. It needs no weights: a random Llama of
SmolLM2-135M's shape (30 layers, hidden 576, 9 heads over 3 KV heads, vocab 49,152) costs
what the real one does. Each T is timed as the median of `repeats` forwards over a cache
holding `context` tokens, in milliseconds; the ratio column is against T=1.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from infra.target import build_tiny_llama
from serve.runner import LlamaRunner

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                     intermediate_size=1536)


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    def once(fn: Callable[[], Any]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t0)

    return once


def run_forward_bench(*, device: str = "cpu", dtype: str = "float32", tokens: tuple[int, ...] = (1, 2, 3, 5, 9, 17, 33),
                      context: int = 256, max_seq_len: int = 2048, repeats: int = 30, json_path: str | None = None,
                      log: Callable[[str], None] = lambda s: print(s, flush=True)) -> dict[str, Any]:
    model = build_tiny_llama(seed=0, max_positions=max_seq_len, dtype=dtype, **SMOLLM2_SHAPE).to(device).eval()
    dev = torch.device(device)
    runners: dict[str, Any] = {"eager": LlamaRunner(model, max_seq_len)}
    if dev.type == "cuda":
        from serve.graphs import GraphLlamaRunner

        runners["graph"] = GraphLlamaRunner(model, max_seq_len)
        runners["graph"].max_graph_tokens = max(tokens)
    once = _timer(dev)
    rows: dict[str, dict[int, float]] = {name: {} for name in runners}
    for name, runner in runners.items():
        cache = runner.new_cache()
        runner.forward(torch.randint(0, 49152, (context,), device=dev), cache)
        for t in tokens:
            block = torch.randint(0, 49152, (t,), device=dev)

            def step() -> None:
                runner.forward(block, cache)
                cache.truncate(context)

            for _ in range(3):  # capture and warm-up
                step()
            rows[name][t] = statistics.median(once(step) for _ in range(repeats))
    log(f"== osd bench forward: SmolLM2-135M shape (random weights), {device}, {dtype}, context {context}, "
        f"median of {repeats}")
    log(f"{'T':>4}" + "".join(f"{name + ' ms':>12}{'vs T=1':>8}" for name in rows))
    for t in tokens:
        log(f"{t:>4}" + "".join(f"{r[t]:>12.3f}{r[t] / r[tokens[0]]:>7.2f}x" for r in rows.values()))
    result = {"device": device, "dtype": dtype, "context": context, "repeats": repeats,
              "ms": {name: {str(t): v for t, v in r.items()} for name, r in rows.items()},
              "torch": torch.__version__}
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2))
        log(f"wrote {json_path}")
    return result
