"""How fast the warm start's teacher answers are written: Hugging Face `generate` (float32,
padded batches) against the serving engine (continuous batching, serving weight format).

The same ShareGPT train prompts go through both, in interleaved rounds (hf, engine, hf,
engine, ...), so a busy machine slows both alike; the table gives each round's generated
tokens per second and the median ratio. Neither side caches: this times generation only.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from infra.config import OSDConfig


def run_teacher_bench(cfg: OSDConfig, prompts: int = 32, rounds: int = 3, max_new_tokens: int | None = None,
                      json_path: str | Path | None = None) -> dict[str, Any]:
    from infra.target import load_target
    from pipeline.teacher_engine import EngineTeacher
    from train.teacher_data import generate_teacher_records
    from train.teacher_set import warm_prompts

    tc = cfg.train
    new = max_new_tokens or tc.warm_max_new_tokens
    pool = warm_prompts(cfg, prompts * rounds)
    if len(pool) < prompts * rounds:
        raise ValueError(f"only {len(pool)} ShareGPT train prompts for {rounds} rounds of {prompts}")
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
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(out, indent=2))
    return out
