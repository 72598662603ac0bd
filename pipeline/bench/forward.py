"""`osd bench forward`: what one target forward of T tokens costs, by weight format, in one run.

The question it answers is the one k and trees depend on: how the verify forward's time
grows with the number of tokens it scores, V(T) = time(T) / time(1). Every variant (a
dtype, or int4 weights with bfloat16 activations; eager, and on CUDA also as a graph) runs
in the same process, interleaved repeat by repeat, so the machine's drift hits them alike.
Without --real it needs no weights: a random Llama of SmolLM2-135M's shape (30 layers,
hidden 576, 9 heads over 3 KV heads, vocab 49,152) costs what the real one does; with
--real it times the real target. Each cell is the median of `repeats` forwards over a
cache holding `context` tokens, in milliseconds.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from tabulate import tabulate

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                     intermediate_size=1536)
# A variant: "float32", "bfloat16", "float16", or "int4" (int4 weights, bfloat16 activations;
# its many-row weights as serving keeps them on this CPU: float32 where bfloat16 GEMMs are
# not native, infra/common/cpu.py), "int4-bf16wide" (int4, its many-row weights bfloat16 on any CPU),
# and "int4-native" (the native forward, serve/model/native_runner.py, over the same weights).
VARIANTS = ("float32", "bfloat16", "float16", "int4", "int4-bf16wide", "int4-native", "int4-native-noamx")


# A pause before each runner's turn, so that it starts on idle cores: the runner before it
# leaves its thread pool spinning for a while (torch's OpenMP, llama.cpp's, the native
# kernels'), which would otherwise charge one method's idle threads to the next. Then one
# untimed forward of the same runner and T, and the timed one right after it: a decode is a
# stream of forwards back to back (as llama-bench's tg is), not one forward after a sleep,
# which would charge the wake-up of its threads to every token.
SETTLE_S = 0.01


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    import torch

    def once(fn: Callable[[], Any]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t0)

    return once


def _cell(once: Callable[[Callable[[], Any]], float], forward: Callable[[], Any], reset: Callable[[], None],
          burst: int) -> float:
    """One cell's time in ms: the median of `burst` timed forwards back to back, each over the
    same cache (reset after each)."""
    times = []
    for _ in range(burst):
        times.append(once(forward))
        reset()
    return statistics.median(times)


def copy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """GB/s moved by copying a tensor far larger than the caches (bytes read plus written), best of `repeats`."""
    import torch

    src = torch.ones(mib << 18, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def _model(variant: str, device: str, max_seq_len: int, real: Any, cache: dict[str, Any]) -> Any:
    """The model a variant runs: one per dtype, shared by eager/graph/int4 runners."""
    import torch

    from infra.target import build_tiny_llama

    dtype = "bfloat16" if variant.startswith("int4") else variant
    if dtype not in cache:
        if real is not None:  # Module.to converts in place: each dtype gets its own copy
            cache[dtype] = copy.deepcopy(real).to(getattr(torch, dtype))
        else:
            cache[dtype] = build_tiny_llama(seed=0, max_positions=max_seq_len, dtype=dtype, **SMOLLM2_SHAPE)
        cache[dtype] = cache[dtype].to(device).eval()
    return cache[dtype]


class AmxPinned:
    """A native runner whose forwards use AMX tiles from `rows` rows (0: never), whatever another
    runner set before it: the library's setting is process-wide."""

    def __init__(self, runner: Any, rows: int):
        self.runner, self.rows = runner, rows

    def forward(self, tokens: Any, cache: Any) -> Any:
        self.runner.lib.osd_set_amx(self.rows)
        return self.runner.forward(tokens, cache)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


class InductorRunner:
    """A runner's fixed-shape forward (forward_static's math) through torch.compile (Inductor),
    one compiled graph per token count; prefill-sized blocks run eagerly. For timing only: it
    answers whether compiling the lean forward pays on this machine."""

    def __init__(self, runner: LlamaRunner):
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.new_cache = runner.new_cache
        self.compile_s = 0.0
        self._seen: set[int] = set()
        self._fn = torch.compile(self._static, dynamic=False)

    def _static(self, tokens: torch.Tensor, start: torch.Tensor, cache: Any) -> torch.Tensor:
        r = self.runner
        slots = start + r.arange[: tokens.shape[0]]
        return r._static_layers(tokens, slots, slots, r.arange.unsqueeze(0) <= slots.unsqueeze(1), cache, ())[0]

    def forward(self, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
        t = tokens.shape[0]
        with torch.no_grad():  # not inference mode: Dynamo cannot trace through it
            if t > MAX_COMPILED_TOKENS:
                return self.runner._run(tokens, cache, ())[0]
            t0 = time.perf_counter()
            out = self._fn(tokens, self.runner.arange[cache.length: cache.length + 1], cache)
            if t not in self._seen:
                self._seen.add(t)
                self.compile_s += time.perf_counter() - t0
        cache.length += t
        return out


MAX_COMPILED_TOKENS = 64


def build_runners(variants: Sequence[str], device: str, max_seq_len: int, max_tokens: int,
                  real: Any = None, inductor: bool = False, vs_llamacpp: bool = False,
                  native_libs: Sequence[str] = ()) -> dict[str, Any]:
    """name -> runner: each variant eagerly, on CUDA each non-int4 variant as graphs too, with
    `inductor` each variant through torch.compile as well, and the native forward once more
    through each library of `native_libs` ("int4-native@<its folder>")."""
    import torch

    from serve.model.runner import LlamaRunner

    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ValueError(f"unknown variant(s) {bad}: expected some of {', '.join(VARIANTS)}")
    if any(v.startswith("int4") for v in variants) and device != "cpu":
        raise ValueError("the int4 variant is the CPU path; drop it with --device cuda")
    if native_libs and device != "cpu":
        raise ValueError("--native-lib times the native CPU forward: drop it with --device cuda")
    models: dict[str, Any] = {}
    runners: dict[str, Any] = {}
    for v in variants:
        model = _model(v, device, max_seq_len, real, models)
        int4 = v.startswith("int4")
        if v.startswith("int4-native"):
            from serve.model.native_runner import NativeLlamaRunner

            # A forward alone takes every thread at any row count, as llama-bench -t does;
            # serving keeps small ones on one thread, the other core being the ingress's.
            native = NativeLlamaRunner(model, max_seq_len, small_rows=0)
            runners[v] = AmxPinned(native, 0 if v == "int4-native-noamx" else native.tuning.amx_rows)
            continue
        runners[v] = LlamaRunner(model, max_seq_len, quant="int4" if int4 else "none",
                                 wide_upcast=False if v == "int4-bf16wide" else None)
        if device == "cuda" and not int4:
            from serve.model.cuda_graphs import GraphLlamaRunner

            runners[f"{v}-graph"] = GraphLlamaRunner(model, max_seq_len)
            runners[f"{v}-graph"].max_graph_tokens = max_tokens
        if inductor:
            runners[f"{v}-inductor"] = InductorRunner(runners[v])
    for path in native_libs:
        from serve.model.native_build import load_file
        from serve.model.native_runner import NativeLlamaRunner

        native = NativeLlamaRunner(_model("int4-native", device, max_seq_len, real, models), max_seq_len,
                                   small_rows=0, lib=load_file(path))
        runners[f"int4-native@{Path(path).parent.name}"] = AmxPinned(native, native.tuning.amx_rows)
    if vs_llamacpp:
        if device != "cpu" or real is None:
            raise ValueError("--vs-llamacpp times llama.cpp on the target's GGUF: it needs --real on the CPU")
        from infra.target import smollm2_gguf_path
        from pipeline.bench.llamacpp import LlamaCppRunner

        runners["llama.cpp"] = LlamaCppRunner(smollm2_gguf_path(), torch.get_num_threads(), max_seq_len)
    return runners


def run_forward_bench(*, device: str = "cpu", variants: Sequence[str] = ("float32", "bfloat16", "int4"),
                      tokens: tuple[int, ...] = (1, 2, 3, 5, 9, 17, 33), context: int = 256,
                      max_seq_len: int = 2048, repeats: int = 30, real: Any = None, inductor: bool = False,
                      vs_llamacpp: bool = False, native_libs: Sequence[str] = (), json_path: str | None = None,
                      burst: int = 1, log: Callable[[str], None] = lambda s: print(s, flush=True)) -> dict[str, Any]:
    """Times every (runner, T) in one run, interleaved per repeat; `real`: the target model to
    time instead of a random one of its shape. A cell is one forward after a pause and an
    untimed one (burst 1), or the median of `burst` forwards back to back, as a busy replica
    runs them: on some machines a lone forward after a pause runs far slower than its steady
    state (docs/benchmarks.md, "AMX tiles")."""
    if burst < 1:
        raise ValueError(f"burst must be at least 1, got {burst}")
    import torch

    dev = torch.device(device)
    runners = build_runners(variants, device, max_seq_len, max(tokens), real, inductor, vs_llamacpp, native_libs)
    vocab = next(iter(runners.values())).vocab_size
    once = _timer(dev)
    gen = torch.Generator().manual_seed(0)
    caches = {}
    for name, runner in runners.items():
        caches[name] = runner.new_cache()
        runner.forward(torch.randint(0, vocab, (context,), generator=gen).to(dev), caches[name])
    times: dict[str, dict[int, list[float]]] = {name: {t: [] for t in tokens} for name in runners}
    blocks = {t: torch.randint(0, vocab, (t,), generator=gen).to(dev) for t in tokens}
    for rep in range(repeats + 3):  # 3 warm-ups (and graph captures)
        for t in tokens:
            for name, runner in runners.items():
                cache = caches[name]
                time.sleep(SETTLE_S)
                runner.forward(blocks[t], cache)
                cache.truncate(context)
                ms = _cell(once, lambda: runner.forward(blocks[t], cache), lambda: cache.truncate(context),
                           burst if rep >= 3 else 1)
                if rep >= 3:
                    times[name][t].append(ms)
    rows = {name: {t: statistics.median(v) for t, v in r.items()} for name, r in times.items()}
    streamed = {name: r.weight_bytes / rows[name][tokens[0]] / 1e6 for name, r in runners.items()
                if getattr(r, "weight_bytes", None) and device == "cpu"}
    result = {"device": device, "variants": list(variants), "context": context, "repeats": repeats, "burst": burst,
              "weights": "real" if real is not None else "random (SmolLM2-135M shape)",
              "ms": {name: {str(t): v for t, v in r.items()} for name, r in rows.items()},
              "vs_t1": {name: {str(t): v / r[tokens[0]] for t, v in r.items()} for name, r in rows.items()},
              "compile_s": {name: r.compile_s for name, r in runners.items() if isinstance(r, InductorRunner)},
              "weights_gb_s": streamed, "copy_gb_s": copy_bandwidth() if streamed else None,
              "native_tuning": {name: {"prefetch": r.tuning.prefetch, "amx_rows": getattr(r, "rows", 0), "one_row_ms": r.tuning.ms}
                                for name, r in runners.items() if getattr(r, "tuning", None)},
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "machine": platform.processor() or platform.machine()}
    print_forward_table(result, rows, tokens, log)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2))
        log(f"wrote {json_path}")
    return result


def print_forward_table(result: dict[str, Any], rows: dict[str, dict[int, float]], tokens: Sequence[int],
                        log: Callable[[str], None]) -> None:
    cell = (f"each the median of {result['burst']} back to back" if result.get("burst", 1) > 1
            else "each one forward after a pause")
    log(f"== osd bench forward: {result['weights']}, {result['device']}, context {result['context']}, "
        f"median of {result['repeats']} ({cell}), {result['threads']} threads; ms per forward (x: vs T=1)")
    table = [[t] + [f"{r[t]:.2f} ms {r[t] / r[tokens[0]]:5.2f}x" for r in rows.values()] for t in tokens]
    for line in tabulate(table, headers=["T", *rows], disable_numparse=True,
                         colalign=("right",) * (len(rows) + 1)).splitlines():
        log(line)
    for name, gbs in result["weights_gb_s"].items():
        log(f"{name}: its T={tokens[0]} forward streams its packed weights at {gbs:.1f} GB/s; this machine "
            f"copies {result['copy_gb_s']:.1f} GB/s (a 256 MiB tensor copy, read + write)")
    for name, t in result["native_tuning"].items():
        if t["one_row_ms"]:
            log(f"{name}: measured at load (ms): "
                + ", ".join(f"{way} {ms:.2f}" for way, ms in t["one_row_ms"].items())
                + f"; it {'prefetches' if t['prefetch'] else 'does not prefetch'}"
                + (f", AMX tiles from {t['amx_rows']} rows" if t["amx_rows"] else ", no AMX tiles"))
    for name, sec in result["compile_s"].items():
        log(f"{name}: compiling took {sec:.0f} s over {len(tokens)} token counts")
    base = rows.get("float32")
    if base:
        log("one-token forward vs float32: " + ", ".join(
            f"{name} {base[tokens[0]] / r[tokens[0]]:.2f}x" for name, r in rows.items() if name != "float32"))


# -- the command line: `osd bench forward` -----------------------------------------------------

HELP = "one target forward of T tokens by weight format, interleaved in one run (eager; on CUDA also graphs)"
ERRORS = (ValueError,)
VARIANT_CHOICES = VARIANTS


def add_arguments(bf: argparse.ArgumentParser) -> None:
    bf.add_argument("--device", default="cpu", help="cpu or cuda")
    bf.add_argument("--variants", nargs="+", choices=VARIANT_CHOICES, metavar="V",
                    help="float32, bfloat16, float16, int4 (int4 weights, bfloat16 activations; CPU; many-row "
                         "weights float32 where this CPU emulates bfloat16), int4-bf16wide (many-row weights "
                         "bfloat16 anyway), int4-native (the native kernels, serve/model/; AMX tiles where "
                         "measured at load to pay) and/or int4-native-noamx (the same without AMX); default: float32 "
                         "bfloat16 int4 int4-native on CPU, bfloat16 on CUDA")
    bf.add_argument("--inductor", action="store_true", help="also time each variant through torch.compile "
                    "(Inductor; a compile per token count, about a minute each on 2 cores)")
    bf.add_argument("--real", action="store_true", help="time the real target (model.target) instead of random "
                                                        "weights of SmolLM2-135M's shape")
    bf.add_argument("--vs-llamacpp", action="store_true", help="also time llama.cpp's forward of the same T tokens "
                    "on the target's own GGUF (with --real; needs the bench extra, llama-cpp-python)")
    bf.add_argument("--native-lib", action="append", default=[], metavar="SO",
                    help="also time the native forward through this library (another build of "
                         "serve/model/native/, e.g. main's), interleaved with the rest; repeatable")
    bf.add_argument("--tokens", default="1,2,3,5,9,17,33", help="comma-separated token counts T")
    bf.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    bf.add_argument("--repeats", type=int, default=30)
    bf.add_argument("--burst", type=int, default=1, metavar="N",
                    help="time N forwards back to back per cell and take their median, as a busy replica runs "
                         "them (default 1: one forward after a pause)")
    bf.add_argument("--json", metavar="PATH", default="reports/bench/forward.json")


def run(cfg: Any, args: argparse.Namespace) -> int:
    try:
        tokens = tuple(int(t) for t in args.tokens.split(",") if t.strip())
    except ValueError:
        tokens = ()
    if not tokens or min(tokens) < 1:
        raise ValueError(f"--tokens must be comma-separated positive integers, got {args.tokens!r}")
    variants = args.variants or (["float32", "bfloat16", "int4", "int4-native"] if args.device == "cpu"
                                 else ["bfloat16"])
    real = None
    if args.real:
        from infra.target import load_target

        real = load_target(cfg.model.target, cfg.model.for_training(), progress=True).model
    run_forward_bench(device=args.device, variants=variants, tokens=tokens, context=args.context,
                      repeats=args.repeats, real=real, inductor=args.inductor, vs_llamacpp=args.vs_llamacpp,
                      native_libs=args.native_lib, json_path=args.json, burst=args.burst)
    return 0
