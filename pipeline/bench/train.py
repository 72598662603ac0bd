"""`osd bench train`: distillation throughput with 1 and 2 workers, and a learning curve.

Records are the target's own outputs (teacher records, cached on disk) for ShareGPT prompts
of one domain: `--records N` train-split prompts are streamed through a private
redis-server to the trainer group; the acceptance estimate is measured on held-out-split
prompts of the same domain, before (the starting draft) and after (the last candidate the
group published), from the records' target distributions alone.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from tabulate import tabulate

from infra.config import OSDConfig


def _log(msg: str) -> None:
    print(f"[osd bench train] {msg}", flush=True)


def run_train_bench(cfg: OSDConfig, *, records: int = 2000, domain: str = "code", eval_prompts: int = 64,
                    workers: tuple[int, ...] = (1, 2), init_draft: str | None = None,
                    json_path: str | Path | None = None) -> dict[str, Any]:
    import ray

    from infra.redis.server import RedisServer
    from infra.target import load_target
    from train.distill.objective import Objective
    from train.online.trainer import estimate_alpha
    from infra.drafts.spec import warm_start_path

    tc = cfg.train
    loaded = load_target(cfg.model.target, cfg.model.for_training(), progress=True)
    default_v1 = warm_start_path(cfg)
    init_draft = init_draft or (str(default_v1) if default_v1.is_dir() else None)
    train_recs, eval_recs = teacher_sets(cfg, loaded, records, eval_prompts, domain)
    alpha_before = estimate_alpha(starting_draft(cfg, loaded, init_draft), eval_recs, tc.max_seq_len)
    _log(f"starting draft {init_draft or 'fresh'}: acceptance estimate on held-out {domain} {alpha_before:.3f}")

    results: dict[int, dict[str, Any]] = {}
    alpha_after = None
    ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory(prefix="osd-bench-train-") as tmp, RedisServer(Path(tmp) / "redis") as redis_srv:
        for w in workers:
            run_cfg = worker_run_config(cfg, redis_srv.url, w, len(train_recs))
            results[w] = time_workers(run_cfg, loaded, train_recs, eval_recs, Path(tmp) / f"run-{w}", init_draft)
            alpha_after = results[w].get("alpha_after", alpha_after)
    out = {
        "tokens_per_s": {str(w): r["tokens_per_s"] for w, r in results.items()},
        "workers": list(workers),
        "zero_stage": tc.zero_stage,
        "records": len(train_recs),
        "domain": domain,
        "alpha_before": alpha_before,
        "alpha_after": alpha_after,
        "alpha_gain": None if alpha_after is None or alpha_before is None else alpha_after - alpha_before,
        "init_draft": init_draft,
        "per_workers": {str(w): r for w, r in results.items()},
        "loss": Objective().loss,
        "lr": tc.lr,
    }
    print_table(results, domain, alpha_before, alpha_after, len(train_recs))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(out, indent=2))
        print(f"wrote {json_path}")
    return out


def teacher_sets(cfg: OSDConfig, loaded: Any, records: int, eval_prompts: int, domain: str) -> tuple[list, list]:
    """Teacher records of `records` train-split and `eval_prompts` held-out prompts of `domain`."""
    from infra.prompts import load_sharegpt
    from train.teacher.sets import teacher_records, warm_prompts

    sharegpt = load_sharegpt(cfg.data)  # both selections from one parse
    train_p = warm_prompts(cfg, records, split="train", domain=domain, prompts=sharegpt)
    eval_p = warm_prompts(cfg, eval_prompts, split="held_out", domain=domain, prompts=sharegpt)
    _log(f"teacher records: {len(train_p)} train + {len(eval_p)} held-out {domain!r} prompts (cached after the first run)")
    return teacher_records(cfg, loaded, train_p), teacher_records(cfg, loaded, eval_p)


def starting_draft(cfg: OSDConfig, loaded: Any, init_draft: str | None) -> Any:
    """The draft training starts from: `init_draft`, or a fresh one built as the trainer would."""
    from infra.drafts.layer import build_draft, load_draft
    from infra.drafts.spec import draft_spec_from_train

    if init_draft:
        return load_draft(init_draft, loaded.model)[0]
    return build_draft(loaded.model, draft_spec_from_train(cfg.train))


def worker_run_config(cfg: OSDConfig, redis_url: str, workers: int, n_records: int) -> OSDConfig:
    """`cfg` on the bench's private stream, with `workers` trainers and one export at the end."""
    return OSDConfig.model_validate({
        **cfg.model_dump(mode="json"),
        "stream": {**cfg.stream.model_dump(mode="json"), "redis_url": redis_url, "stream": f"bench:train:{workers}",
                   "lag_budget": 0, "maxlen": max(cfg.stream.maxlen, n_records + 1)},
        "train": {**cfg.train.model_dump(mode="json"), "num_workers": workers,
                  # one candidate at the end, so exports do not dominate the timing
                  "export_every_records": n_records + 1, "export_every_s": 1e9},
    })


def time_workers(run_cfg: OSDConfig, loaded: Any, train_recs: list, eval_recs: list, run_dir: Path,
                 init_draft: str | None) -> dict[str, Any]:
    """Stream the train records, train a group on them until the stream is idle, and score the
    candidate it exported on the held-out records."""
    import dataclasses

    from infra.drafts.layer import load_draft
    from infra.records.schema import new_record_id
    from infra.records.streams import RecordProducer
    from train.online.trainer import TrainerGroup, estimate_alpha

    tc, w = run_cfg.train, run_cfg.train.num_workers
    with RecordProducer(run_cfg.stream.redis_url, run_cfg.stream) as prod:
        for r in train_recs:
            prod.submit(dataclasses.replace(r, record_id=new_record_id()))
        prod.flush(120)
    _log(f"{w} worker(s), ZeRO-{tc.zero_stage}: training on {len(train_recs)} records")
    group = TrainerGroup(run_cfg, run_dir, init_draft=init_draft)
    try:
        t0 = time.perf_counter()
        stats = group.run(idle_stop_s=5, timeout=7200)
        wall = time.perf_counter() - t0 - 5  # minus the idle wait that ends the run
    finally:
        group.shutdown()
    tokens = sum(s.tokens for s in stats)
    result = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
              "records": sum(s.records_trained for s in stats), "steps": max(s.steps for s in stats)}
    _log(f"{w} worker(s): {tokens} tokens in {wall:.1f} s = {tokens / wall:.0f} tokens/s")
    exports = stats[0].exports
    if exports:
        cand, _ = load_draft(exports[-1]["path"], loaded.model)
        result["alpha_after"] = estimate_alpha(cand, eval_recs, tc.max_seq_len)
    return result


def print_table(results: dict[int, dict[str, Any]], domain: str, alpha_before: float, alpha_after: float | None,
                n_records: int) -> None:
    rows = [[w, r["tokens"], f"{r['wall_s']:.1f}", f"{r['tokens_per_s']:.0f}",
             "" if r.get("alpha_after") is None else f"{r['alpha_after']:.3f}"] for w, r in results.items()]
    print("\n" + tabulate(rows, headers=["workers", "tokens", "seconds", "tokens/s", "alpha after"],
                         disable_numparse=True, colalign=("right",) * 5))
    print(f"acceptance estimate on held-out {domain}: {alpha_before:.3f} -> "
          f"{'n/a' if alpha_after is None else f'{alpha_after:.3f}'} after {n_records} records")


# -- the command line: `osd bench train` -------------------------------------------------------

HELP = "distillation tokens/s with 1 and 2 workers, and alpha before/after"
ERRORS: tuple[type[Exception], ...] = ()


def add_arguments(bt: argparse.ArgumentParser) -> None:
    bt.add_argument("--records", type=int, default=2000, help="train records of one domain (default 2000)")
    bt.add_argument("--domain", default="code", choices=["code", "math", "writing", "other"])
    bt.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts for alpha (default 64)")
    bt.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to time (default 1 2)")
    bt.add_argument("--init-draft", help="starting draft dir (default <state_dir>/drafts/v1 if present)")
    bt.add_argument("--json", default="reports/bench/train.json", metavar="PATH")


def run(cfg: OSDConfig, args: argparse.Namespace) -> int:
    run_train_bench(cfg, records=args.records, domain=args.domain, eval_prompts=args.eval_prompts,
                    workers=tuple(args.workers), init_draft=args.init_draft, json_path=args.json)
    return 0
