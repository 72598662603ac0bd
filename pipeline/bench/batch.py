"""`osd bench batch`: one in-process engine under 1 to N concurrent clients, on the CPU or a GPU.

Each level runs C clients, each streaming `--requests` requests back to back (after a round of
one request a client, not timed, as a replica's warm-up), every request a prompt no earlier
request of the run has sent (so the suffix draft meets first-time prompts,
and a fresh draft serves each level). With `--speculation both` each level runs speculation
on and off one after the other, so the two are compared at the same load in one run. Per
level: output tokens/s, sequences and rows per target forward (the scheduler's step log:
continuous batching at work), and the ratio to one client.

No HTTP and no Ray: what it times is the engine's batched step, so it runs where serving's
stack does not (a GPU machine with torch alone). `osd bench load` times the served endpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
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
    p.add_argument("--max-prompt-chars", type=int, default=1000, help="skip longer ShareGPT prompts")
    p.add_argument("--json", metavar="PATH", default="reports/bench/batch.json", help="where to write JSON")


async def _level(engine: Any, params: Any, draft: Any, ids: list[list[int]], clients: int,
                 per_client: int) -> tuple[int, float]:
    """(output tokens, seconds) of `clients` workers streaming their requests back to back."""
    async def worker(j: int) -> int:
        got = 0
        for r in range(per_client):
            stream = engine.stream(ids[j * per_client + r], params, draft)
            async for _ in stream:
                pass
            got += len(stream.result.output_ids)
        return got

    t0 = time.perf_counter()
    tokens = await asyncio.gather(*[worker(j) for j in range(clients)])
    return sum(tokens), time.perf_counter() - t0


def run_levels(engine: Any, make_draft: Callable[[], Any], ids: list[list[int]], clients: list[int],
               per_client: int, max_new: int, modes: tuple[bool, ...],
               log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every (level, mode), each on prompts of its own; a row per run."""
    from serve.engine.core import GenerationParams

    rows, at = [], 0
    for c in clients:
        for spec in modes:
            need = c * per_client + c
            if at + need > len(ids):
                raise ValueError(f"{len(ids)} prompts are too few: the levels need "
                                 f"{sum(clients) * (per_client + 1) * len(modes)} (one per request)")
            params = GenerationParams(max_new_tokens=max_new, speculate=spec, capture=False)
            # A round of one request a client first, not timed: what a replica does once in its
            # life (CUDA graphs captured for the level's shapes, the cost profile) stays out.
            asyncio.run(_level(engine, params, make_draft() if spec else None, ids[at:at + c], c, 1))
            at += c
            need -= c
            seen = engine.scheduler.log.total
            tokens, secs = asyncio.run(_level(engine, params, make_draft() if spec else None,
                                              ids[at:at + need], c, per_client))
            at += need
            steps = engine.scheduler.log.since(seen)
            row = {"clients": c, "speculation": spec, "requests": need, "tokens": tokens, "seconds": secs,
                   "tok_s": tokens / secs, "forwards": len(steps),
                   "seqs_per_forward": sum(s for _, s, _ in steps) / max(1, len(steps)),
                   "rows_per_forward": sum(r for _, _, r in steps) / max(1, len(steps))}
            rows.append(row)
            log(f"  {c} clients, speculation {'on' if spec else 'off'}: {row['tok_s']:.1f} tok/s, "
                f"{row['seqs_per_forward']:.1f} sequences a forward")
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    base = {r["speculation"]: r["tok_s"] for r in rows if r["clients"] == rows[0]["clients"]}
    body = [[r["clients"], "on" if r["speculation"] else "off", r["requests"], f"{r['tok_s']:.1f}",
             f"{r['tok_s'] / base[r['speculation']]:.2f}x", f"{r['seqs_per_forward']:.2f}",
             f"{r['rows_per_forward']:.2f}"] for r in rows]
    return tabulate(body, headers=["clients", "spec", "requests", "out tok/s", f"vs {rows[0]['clients']} client(s)",
                                   "seqs/forward", "rows/forward"])


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
    prompts = select_prompts(cfg.data, None, args.prompts_file,
                             max_prompt_chars=None if args.prompts_file else args.max_prompt_chars)
    ids = [messages_ids(loaded.tokenizer, p.chat()) for p in prompts]
    update = {"k": args.k, "cuda_graphs": args.compile, "max_concurrency": max(clients), "max_queue": 4 * max(clients)}
    options = EngineOptions.from_config(cfg.serve.model_copy(update=update), mcfg)

    def draft() -> Any:
        return build_draft(args.draft, loaded.model, suffix=cfg.serve.suffix)

    engine = SpecEngine(loaded.model, draft(), loaded.tokenizer, options)
    ids = [x for x in ids if len(x) + args.max_new_tokens <= engine.max_seq_len]  # what the context holds
    print(f"== osd bench batch: target {loaded.spec}, draft {args.draft}, k={args.k}, device={args.device}, "
          f"dtype={mcfg.dtype}, quant={mcfg.quant}, levels {clients}, {args.requests} requests a client, "
          f"{args.max_new_tokens} tokens each", flush=True)
    rows = run_levels(engine, lambda: engine.make_draft(draft()), ids, clients, args.requests,
                      args.max_new_tokens, modes, lambda s: print(s, flush=True))
    print(table(rows))
    result = {"rows": rows, "target": loaded.spec, "draft": args.draft, "k": args.k, "device": args.device,
              "dtype": mcfg.dtype, "quant": mcfg.quant, "max_new_tokens": args.max_new_tokens,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0
