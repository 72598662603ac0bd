"""How fast the warm start's teacher answers are written: Hugging Face `generate` (float32,
padded batches) against the serving engine (continuous batching, serving weight format).

The same ShareGPT train prompts go through both, in interleaved rounds (hf, engine, hf,
engine, ...), so a busy machine slows both alike; the table gives each round's generated
tokens per second and the median ratio. Neither side caches: this times generation only.

`--batches B,B,...` compares the engine at those concurrencies (`train.warm_batch_size`)
instead, each capturing the head's features as `osd draft init` does (its prompts and answer
length: train.head_warm_*), in interleaved rounds over the same prompts; the first batch size
is the baseline of the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from infra.config import OSDConfig
from pipeline.argtypes import sizes


def _prompt_pool(cfg: OSDConfig, prompts: int, rounds: int) -> list:
    """rounds * prompts distinct ShareGPT train prompts, or a clear error when there are fewer."""
    from train.teacher.sets import warm_prompts

    pool = warm_prompts(cfg, prompts * rounds)
    if len(pool) < prompts * rounds:
        raise ValueError(f"only {len(pool)} ShareGPT train prompts for {rounds} rounds of {prompts}")
    return pool


def _write_json(out: dict[str, Any], json_path: str | Path | None) -> None:
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(out, indent=2))


def run_teacher_bench(cfg: OSDConfig, prompts: int = 32, rounds: int = 3, max_new_tokens: int | None = None,
                      json_path: str | Path | None = None, batches: tuple[int, ...] = ()) -> dict[str, Any]:
    if batches:
        return _run_batch_bench(cfg, prompts, rounds, max_new_tokens, json_path, batches)
    from infra.target import load_target
    from pipeline.teacher.engine import EngineTeacher
    from train.teacher.data import generate_teacher_records
    tc = cfg.train
    new = max_new_tokens or tc.warm_max_new_tokens
    pool = _prompt_pool(cfg, prompts, rounds)
    f32 = load_target(cfg.model.target, cfg.model.for_training(), progress=False)
    engine = EngineTeacher(cfg)
    ways = {"hf": lambda chunk: generate_teacher_records(f32.model, f32.tokenizer, chunk, max_new_tokens=new,
                                                         top_k=cfg.serve.capture_top_k,
                                                         batch_size=tc.warm_batch_size, progress=False),
            engine.tag: lambda chunk: generate_teacher_records(f32.model, f32.tokenizer, chunk, max_new_tokens=new,
                                                               top_k=cfg.serve.capture_top_k, progress=False,
                                                               generate=engine)}
    engine([[1, 2, 3]], 2, cfg.serve.capture_top_k, None)  # load and warm up outside the timed rounds
    rows: list[dict[str, Any]] = []
    for r in range(rounds):
        chunk = pool[r * prompts:(r + 1) * prompts]
        for name, way in ways.items():
            t0 = time.perf_counter()
            recs = way(chunk)
            dt = time.perf_counter() - t0
            tokens = sum(len(x.output_ids) for x in recs)
            rows.append({"round": r, "generator": name, "prompts": len(chunk), "tokens": tokens, "seconds": dt,
                         "tok_s": tokens / dt})
            print(f"round {r}  {name:12s} {len(chunk):4d} prompts {tokens:6d} tokens {dt:7.1f} s "
                  f"{tokens / dt:7.1f} tok/s", flush=True)
    ratios = [e["tok_s"] / h["tok_s"] for h, e in zip(rows[0::2], rows[1::2])]
    out = {"prompts_per_round": prompts, "rounds": rounds, "max_new_tokens": new,
           "batch": tc.warm_batch_size, "rows": rows, "engine_over_hf_median": statistics.median(ratios)}
    print(f"engine / hf generated tok/s, median of {rounds} interleaved rounds: {out['engine_over_hf_median']:.2f}x")
    _write_json(out, json_path)
    return out


def _run_batch_bench(cfg: OSDConfig, prompts: int, rounds: int, max_new_tokens: int | None,
                     json_path: str | Path | None, batches: tuple[int, ...]) -> dict[str, Any]:
    from infra.drafts.head import default_feature_layers
    from infra.prompts import chat_ids
    from infra.target import load_target
    from pipeline.teacher.engine import EngineTeacher

    if len(batches) < 2 or min(batches) < 1:
        raise ValueError(f"--batches needs two or more sizes >= 1, got {','.join(map(str, batches))}")
    cfg = cfg.for_warm_start("head")  # the head's prompts and answer length, as its `osd draft init`
    new = max_new_tokens or cfg.train.warm_max_new_tokens
    pool = _prompt_pool(cfg, prompts, rounds)
    loaded = load_target(cfg.model.target, cfg.model, progress=False)
    layers = default_feature_layers(loaded.model.config.num_hidden_layers)
    top_k = cfg.serve.capture_top_k
    teachers = {b: EngineTeacher(cfg.model_copy(update={"train": cfg.train.model_copy(update={"warm_batch_size": b})}),
                                 loaded) for b in batches}
    for t in teachers.values():  # build each engine and warm it up outside the timed rounds
        t.capture([[1, 2, 3]], 2, top_k, None, layers)
    rows: list[dict[str, Any]] = []
    for r in range(rounds):
        ids = [chat_ids(loaded.tokenizer, p.text) for p in pool[r * prompts:(r + 1) * prompts]]
        for b, teacher in teachers.items():
            t0 = time.perf_counter()
            answers = teacher.capture(ids, new, top_k, None, layers)
            dt = time.perf_counter() - t0
            tokens = sum(len(a[0]) for a, _ in answers)
            rows.append({"round": r, "batch": b, "prompts": len(ids), "tokens": tokens, "seconds": dt,
                         "tok_s": tokens / dt})
            print(f"round {r}  batch {b:4d} {len(ids):4d} prompts {tokens:6d} tokens {dt:7.1f} s "
                  f"{tokens / dt:7.1f} tok/s", flush=True)
    base = batches[0]
    ratios = {b: statistics.median(x["tok_s"] / y["tok_s"] for x, y in zip(
        [e for e in rows if e["batch"] == b], [e for e in rows if e["batch"] == base])) for b in batches[1:]}
    for b, q in ratios.items():
        print(f"batch {b} / batch {base} generated tok/s, median of {rounds} interleaved rounds: {q:.2f}x")
    out = {"prompts_per_round": prompts, "rounds": rounds, "max_new_tokens": new, "feature_layers": list(layers),
           "batches": list(batches), "rows": rows, "over_first_median": {str(b): q for b, q in ratios.items()}}
    _write_json(out, json_path)
    return out


# -- the command line: `osd bench teacher` -----------------------------------------------------

HELP = ("warm-start teacher answers: Hugging Face generate against the serving engine's continuous batching, "
        "interleaved rounds")
ERRORS = (ValueError,)


def add_arguments(bt: argparse.ArgumentParser) -> None:
    bt.add_argument("--prompts", type=int, default=32, metavar="N", help="ShareGPT train prompts a round (default 32)")
    bt.add_argument("--rounds", type=int, default=3, metavar="R", help="interleaved rounds (default 3)")
    bt.add_argument("--max-new-tokens", type=int, metavar="M",
                    help="default train.warm_max_new_tokens (--batches: train.head_warm_max_new_tokens)")
    bt.add_argument("--batches", metavar="B,B,...", type=sizes, default=(),
                    help="compare the engine at these concurrencies instead (train.warm_batch_size; the first is "
                         "the baseline), capturing the head's features as osd draft init does")
    bt.add_argument("--json", metavar="PATH", default="reports/bench/teacher.json", help="where to write JSON")


def run(cfg: OSDConfig, args: argparse.Namespace) -> int:
    run_teacher_bench(cfg, prompts=args.prompts, rounds=args.rounds, max_new_tokens=args.max_new_tokens,
                      json_path=args.json, batches=args.batches)
    return 0
