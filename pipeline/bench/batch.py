"""`osd bench batch`: one in-process engine under 1 to N concurrent clients, on the CPU or a GPU.

Each level runs C clients, each streaming `--requests` requests back to back (after a round of
one request a client, not timed, as a replica's warm-up), every request a prompt no earlier
request of the run has sent (so the suffix draft meets first-time prompts,
and a fresh draft serves each level). With `--speculation both` each level runs speculation
on and off one after the other on the same prompts (each run's untimed round fills the KV
slots first, and each run reuses the prefixes of its own requests alone: its own cache salt),
so the two are compared at the same load and on the same answers in one run (`on_off`). Per
level: output tokens/s, sequences and rows per target forward (the scheduler's step log:
continuous batching at work), the ratio to one client, the median time to a first token and
the share of prompt tokens a KV slot already held (serve/engine/prefix.py).

`--workload multiturn` sends held-out conversations' second turns, each right after the
engine's own answer to the first, as a chat client does; `--prefix-reuse both` runs every
level on an engine with prefix reuse and one without, on the same requests.

No HTTP and no Ray: what it times is the engine's batched step, so it runs where serving's
stack does not (a GPU machine with torch alone). `osd bench load` times the served endpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from tabulate import tabulate

from infra.config import OSDConfig
from infra.prompts import messages_ids, select_prompts
from pipeline.argtypes import positive_int, sizes

HELP = "the engine at 1..N concurrent clients in one process (no HTTP): tok/s, sequences per forward"
ERRORS = (ValueError,)
MODES = {"both": (True, False), "on": (True,), "off": (False,)}
REUSE = {"both": ("on", "off"), "on": ("on",), "off": ("off",)}
ALL_PROMPTS = 10**9


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=sizes, default="1,8,16", metavar="C,C,...",
                   help="concurrency levels, comma-separated (default 1,8,16)")
    p.add_argument("--requests", type=positive_int, default=2, metavar="N", help="requests per client per level")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, metavar="M")
    p.add_argument("--speculation", choices=tuple(MODES), default="both")
    p.add_argument("--draft", default="suffix", metavar="SPEC", help="draft spec (default suffix)")
    p.add_argument("--k", type=positive_int, default=4, metavar="K")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto", help="CUDA graphs (auto: on CUDA)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="model dtype (default: model.dtype)")
    p.add_argument("--target", help="target spec (default: model.target)")
    p.add_argument("--prompts-file", metavar="F", help="JSONL with a prompt field instead of ShareGPT")
    p.add_argument("--workload", choices=("single", "multiturn"), default="single",
                   help="single: first turns; multiturn: held-out conversations' second turns, each sent after "
                        "the engine's own answer to the first (both turns timed)")
    p.add_argument("--prefix-reuse", choices=tuple(REUSE), default="on",
                   help="serve.prefix_reuse; both: an engine with and one without, on the same prompts")
    p.add_argument("--max-prompt-chars", type=int, default=1000, help="skip longer ShareGPT prompts")
    p.add_argument("--json", metavar="PATH", default="reports/bench/batch.json", help="where to write JSON")


async def _serve(engine: Any, params: Any, draft: Any, item: Any, tokenizer: Any) -> tuple[int, list[float]]:
    """One client's request: token ids, or a conversation (user turns, each sent after the
    engine's own answers to the ones before, as a chat client does). (Output tokens, seconds to
    the first token of each turn.)"""
    turns = item if isinstance(item, tuple) else (item,)
    messages: list[dict[str, str]] = []
    tokens, ttft = 0, []
    for turn in turns:
        if isinstance(turn, str):
            messages.append({"role": "user", "content": turn})
            turn = messages_ids(tokenizer, messages)
        t0, first = time.perf_counter(), None
        stream = engine.stream(turn, params, draft)
        async for _ in stream:
            if first is None:
                first = time.perf_counter() - t0
        ttft.append(first if first is not None else time.perf_counter() - t0)
        tokens += len(stream.result.output_ids)
        messages.append({"role": "assistant", "content": stream.result.text or ""})
    return tokens, ttft


async def _level(engine: Any, params: Any, draft: Any, items: list[Any], clients: int,
                 per_client: int, tokenizer: Any = None) -> tuple[int, float, list[list[float]]]:
    """(output tokens, seconds, each request's seconds to first tokens) of `clients` workers
    sending their requests back to back."""
    async def worker(j: int) -> list[tuple[int, list[float]]]:
        return [await _serve(engine, params, draft, items[j * per_client + r], tokenizer) for r in range(per_client)]

    t0 = time.perf_counter()
    done = [r for w in await asyncio.gather(*[worker(j) for j in range(clients)]) for r in w]
    return sum(n for n, _ in done), time.perf_counter() - t0, [t for _, t in done]


def _ttft_ms(ttfts: list[list[float]]) -> list[float]:
    """The median seconds to a first token of each turn, in ms."""
    return [round(1000 * statistics.median(t[i] for t in ttfts), 1) for i in range(len(ttfts[0]))]


def run_levels(engine: Any, make_draft: Callable[[Any], Any], items: list[Any], clients: list[int],
               per_client: int, max_new: int, modes: tuple[bool, ...],
               log: Callable[[str], None] = print, engines: dict[str, Any] | None = None,
               tokenizer: Any = None) -> list[dict[str, Any]]:
    """Every level on prompts of its own, each of its runs (a mode on an engine) on the same
    prompts, in an order that alternates from level to level; a row per run. items: token ids,
    or conversations (tuples of user turns, tokenized with `tokenizer`). engines: prefix reuse
    "on" / "off" -> engine (else every run is on `engine`). make_draft(engine): a fresh draft."""
    from serve.engine.core import GenerationParams

    arms = [(reuse, spec, eng) for spec in modes for reuse, eng in (engines or {"": engine}).items()]
    need = [c * per_client + c for c in clients]
    if sum(need) > len(items):
        raise ValueError(f"{len(items)} prompts are too few: the levels need {sum(need)} (one per request)")
    rows, at = [], 0
    for li, c in enumerate(clients):
        for reuse, spec, eng in arms if li % 2 == 0 else arms[::-1]:
            # A cache salt per run: a run reuses the prefixes of its own requests only, never the
            # prompts the level's other run left in the KV slots (with a few requests, every one).
            params = GenerationParams(max_new_tokens=max_new, speculate=spec, capture=False,
                                      cache_salt=f"osd-bench-batch-{c}-{reuse}-{'on' if spec else 'off'}")
            rows.append(_run(eng, make_draft if spec else None, params, items[at:at + need[li]], c, per_client,
                             tokenizer, reuse, log))
        at += need[li]
    _on_off(rows)
    return rows


def _on_off(rows: list[dict[str, Any]]) -> None:
    """Each speculative row's tok/s over its level's run without speculation (same prompts)."""
    off = {(r["clients"], r["prefix_reuse"]): r["tok_s"] for r in rows if not r["speculation"]}
    for r in rows:
        base = off.get((r["clients"], r["prefix_reuse"]))
        r["on_off"] = r["tok_s"] / base if r["speculation"] and base else None


def _run(eng: Any, make_draft: Callable[[Any], Any] | None, params: Any, items: list[Any], c: int,
         per_client: int, tokenizer: Any, reuse: str, log: Callable[[str], None]) -> dict[str, Any]:
    # A round of one request a client first, not timed: what a replica does once in its life
    # (CUDA graphs captured for the level's shapes, the cost profile) stays out. One draft for
    # both rounds, as a replica keeps its draft: one that reads the target's features takes a
    # held prefix only where its own draft object left it (serve/engine/scheduler.py _usable),
    # so a fresh one could not reuse the prefixes the warm-up left, which plain requests do.
    draft = make_draft(eng) if make_draft else None
    asyncio.run(_level(eng, params, draft, items[:c], c, 1, tokenizer))
    sched = eng.scheduler
    seen, prompt0, cached0 = sched.log.total, sched.prompt_tokens, sched.cached_tokens
    tokens, secs, ttfts = asyncio.run(_level(eng, params, draft, items[c:], c, per_client, tokenizer))
    steps = sched.log.since(seen)
    prompt = sched.prompt_tokens - prompt0
    row = {"clients": c, "speculation": params.speculate, "requests": len(items) - c, "tokens": tokens,
           "seconds": secs, "tok_s": tokens / secs, "forwards": len(steps),
           "seqs_per_forward": sum(s for _, s, _ in steps) / max(1, len(steps)),
           "rows_per_forward": sum(r for _, _, r in steps) / max(1, len(steps)),
           "ttft_ms": _ttft_ms(ttfts), "prefix_reuse": reuse or None,
           "cached_share": (sched.cached_tokens - cached0) / prompt if prompt else 0.0}
    log(f"  {c} clients, speculation {'on' if params.speculate else 'off'}"
        f"{f', prefix reuse {reuse}' if reuse else ''}: {row['tok_s']:.1f} tok/s, "
        f"{row['seqs_per_forward']:.1f} sequences a forward, first token {row['ttft_ms']} ms")
    return row


def table(rows: list[dict[str, Any]]) -> str:
    first = rows[0]["clients"]
    base = {(r["speculation"], r["prefix_reuse"]): r["tok_s"] for r in rows if r["clients"] == first}
    body = [[r["clients"], "on" if r["speculation"] else "off", r["prefix_reuse"] or "-", r["requests"],
             f"{r['tok_s']:.1f}", f"{r['tok_s'] / base[(r['speculation'], r['prefix_reuse'])]:.2f}x",
             f"{r['seqs_per_forward']:.2f}", f"{r['rows_per_forward']:.2f}",
             " / ".join(f"{t:.0f}" for t in r["ttft_ms"]), f"{r['cached_share']:.0%}",
             f"{r['on_off']:.2f}x" if r.get("on_off") else "-"] for r in rows]
    return tabulate(body, headers=["clients", "spec", "prefix reuse", "requests", "out tok/s", f"vs {first} client(s)",
                                   "seqs/forward", "rows/forward", "first token ms (per turn)", "prompt cached",
                                   "on / off"])


def _items(cfg: OSDConfig, args: argparse.Namespace, tokenizer: Any, max_seq_len: int) -> list[Any]:
    """The requests: token ids of single prompts, or (first, second) user turns of held-out
    ShareGPT conversations (`--workload multiturn`), those the context holds."""
    if args.workload == "multiturn":
        from pipeline.bench.engine import conversation_turns

        if args.prompts_file:
            raise ValueError("--workload multiturn takes its conversations from ShareGPT, not --prompts-file")
        return [c for c in conversation_turns(cfg, ALL_PROMPTS, args.max_prompt_chars)
                if sum(len(messages_ids(tokenizer, [{"role": "user", "content": t}])) for t in c)
                + 2 * args.max_new_tokens <= max_seq_len]
    # Every held-out first turn (select_prompts takes 32 of ShareGPT's unless told how many):
    # the default levels need 75.
    prompts = select_prompts(cfg.data, None if args.prompts_file else ALL_PROMPTS, args.prompts_file,
                             max_prompt_chars=None if args.prompts_file else args.max_prompt_chars)
    ids = [messages_ids(tokenizer, p.chat()) for p in prompts]
    return [x for x in ids if len(x) + args.max_new_tokens <= max_seq_len]


def run(cfg: OSDConfig, args: argparse.Namespace) -> int:
    import torch

    from infra.target import load_target
    from pipeline.bench.engine import bench_model_config
    from serve.engine.core import EngineOptions, SpecEngine
    from serve.spec_decode.specs import build_draft

    clients = list(args.clients)
    modes = MODES[args.speculation]
    mcfg = bench_model_config(cfg, args.device, args.target, args.dtype, None)
    loaded = load_target(mcfg.target, mcfg, progress=True)
    update = {"k": args.k, "cuda_graphs": args.compile, "max_concurrency": max(clients), "max_queue": 4 * max(clients)}

    def draft() -> Any:
        return build_draft(args.draft, loaded.model, suffix=cfg.serve.suffix)

    engines = {}
    for reuse in REUSE[args.prefix_reuse]:
        serve = cfg.serve.model_copy(update={**update, "prefix_reuse": reuse == "on"})
        engines[reuse] = SpecEngine(loaded.model, draft(), loaded.tokenizer, EngineOptions.from_config(serve, mcfg))
    engine = next(iter(engines.values()))
    items = _items(cfg, args, loaded.tokenizer, engine.max_seq_len)
    print(f"== osd bench batch: target {loaded.spec}, draft {args.draft}, k={args.k}, device={args.device}, "
          f"dtype={mcfg.dtype}, quant={mcfg.quant}, levels {clients}, {args.requests} requests a client, "
          f"{args.max_new_tokens} tokens each, {args.workload}, prefix reuse {args.prefix_reuse}", flush=True)
    rows = run_levels(engine, lambda eng: eng.make_draft(draft()), items, clients, args.requests,
                      args.max_new_tokens, modes, lambda s: print(s, flush=True),
                      engines if args.prefix_reuse == "both" else None, loaded.tokenizer)
    print(table(rows))
    result = {"rows": rows, "target": loaded.spec, "draft": args.draft, "k": args.k, "device": args.device,
              "workload": args.workload, "prefix_reuse": args.prefix_reuse,
              "dtype": mcfg.dtype, "quant": mcfg.quant, "max_new_tokens": args.max_new_tokens,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0
