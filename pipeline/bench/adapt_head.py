"""`osd bench adapt --family head`: the online head trainer after the demo's shift, offline.

The warm-start head v1 (`osd draft init --family head`) meets a stream of code records, a few at a
time, through the online trainer's own family (train/online/family.py HeadFamily: its batches,
its loss, its features from the served target), each step followed by `train.replay_steps`
steps on records drawn again from the recent ones, as train/online/trainer.py steps. After
`checkpoints` records the candidate is scored against v1 on the *same* held-out records with the
gate's measure (the acceptance lower bound per position) and its paired interval, on held-out
code prompts (did it learn the new domain?) and held-out general ones (did it forget the old?).

Variants (each from v1, the same seeded record order):
- `base`: the demo's online settings, the loss on each record's output rows;
- `all_rows`: the loss on its prompt rows too (train.head_loss_rows "all");
- `low_lr`: a third of the learning rate; `high_lr`: three times it;
- `more_replay`: twice the replay steps after each new step (what the output rows' cheaper
  steps could buy in the same trainer time);
- `no_replay`, `three_replays`: no replay step after each new step, or three (the demo's
  setting before 2026-12-06): in the demo the trainer skips most records as stale, so a replay
  step costs a new record's step; compare variants at equal trainer time, not equal records;
- `ce`, `tv`, `ce_tv`: train.head_loss "ce" (the soft cross-entropy, the default before
  2026-12-07), "tv" (the total variation 1 - sum(min(p, q)), what the gate's acceptance bound
  counts) or "ce+tv" (their sum, the default).
Each checkpoint scores both the acceptance bound (speculative sampling's) and greedy agreement
(what a greedy request's verify accepts): a loss can move one and not the other.
Each row also says how long the variant's optimizer steps took (the rows a loss counts decide
a step's cost) and how long the target's forwards for its records' features took (once a
record: the family keeps them), the trainer's two costs a record.

Records are teacher records (the target's own greedy answers, the head warm start's answer
length) in place of served ones.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any, Sequence

from infra.config import OSDConfig

HEAD_VARIANTS = ("base", "all_rows", "low_lr", "high_lr", "more_replay", "no_replay", "three_replays", "ce", "tv",
                 "ce_tv")


class VariantError(ValueError):
    """A variant this bench does not know for the family asked: the user's to fix."""


def _log(msg: str) -> None:
    print(f"[osd bench adapt] {msg}", flush=True)


def head_variant_config(cfg: OSDConfig, name: str) -> OSDConfig:
    """One head variant on top of `cfg` (the demo's online settings)."""
    tc = cfg.train
    changes = {"base": {}, "all_rows": {"head_loss_rows": "all"}, "low_lr": {"lr": tc.lr / 3},
               "high_lr": {"lr": tc.lr * 3}, "more_replay": {"replay_steps": 2 * tc.replay_steps},
               "no_replay": {"replay_steps": 0}, "three_replays": {"replay_steps": 3},
               "ce": {"head_loss": "ce"}, "tv": {"head_loss": "tv"}, "ce_tv": {"head_loss": "ce+tv"}}
    if name not in changes:
        raise VariantError(f"unknown head variant {name!r}; known: {', '.join(HEAD_VARIANTS)}")
    return cfg.model_copy(update={"train": tc.model_copy(update=changes[name])})


def head_sets(cfg: OSDConfig, loaded: Any, records: int, eval_prompts: int, generate: Any) -> dict[str, list]:
    """Teacher records (cached; answers as long as the head warm start's): the code stream,
    held-out code and held-out general prompts."""
    from infra.prompts import load_sharegpt, unique_texts
    from train.teacher.sets import teacher_records

    sharegpt = load_sharegpt(cfg.data)

    def pick(split: str, code: bool, n: int) -> list:
        return unique_texts([p for p in sharegpt if p.split == split and (p.domain == "code") == code
                             and len(p.text) <= 600])[:n]

    sets = {"stream": pick("train", True, records), "held_code": pick("held_out", True, eval_prompts),
            "held_general": pick("held_out", False, eval_prompts)}
    _log(", ".join(f"{len(v)} {k}" for k, v in sets.items()) + " prompts")
    answers = cfg.for_warm_start("head")
    return {k: teacher_records(answers, loaded, v, generate=generate) for k, v in sets.items()}


def mean_alpha(scores: list) -> float:
    """Acceptance per position over records scored as (sum, positions) each."""
    return sum(s for s, _ in scores) / sum(n for _, n in scores)


def paired_scores(cand: list, parent: list) -> dict[str, float]:
    """Candidate minus parent per position on the same records (per-record (sum, positions)
    scores of each), with the gate's interval: both families' benches report this."""
    from train.gate.compare import paired_interval

    diffs = [c - s for (c, _), (s, _) in zip(cand, parent)]
    d, lo, hi = paired_interval(diffs, [n for _, n in cand], resamples=1000)
    return {"alpha": mean_alpha(cand), "diff": d, "lower": lo, "upper": hi}


def both_scores(scorer: Any, head: Any, records: list) -> tuple[list, list]:
    """(acceptance bound, greedy agreement) per record as (sum, positions), from one unroll."""
    both = scorer.scores(head, records)
    return [(b, n) for b, _, n in both], [(g, n) for _, g, n in both]


def run_head_variant(cfg: OSDConfig, name: str, loaded: Any, v1_dir: Path, sets: dict[str, list],
                     scorer: Any, parent: dict[str, list], checkpoints: Sequence[int], arrive: int, seed: int,
                     forward: Any) -> list[dict]:
    """Train one variant from v1 over the stream, as the online trainer steps; score at each checkpoint."""
    from infra.drafts.layer import load_draft
    from train.distill.batching import take_budget
    from train.distill.ds_engine import DistillEngine
    from train.online.family import HeadFamily
    from train.online.replay import replay_pool
    from train.online.trainer import REPLAY_BUFFER

    tc = head_variant_config(cfg, name).train
    head, _ = load_draft(str(v1_dir), loaded.model)
    fam = HeadFamily(loaded.model, tc, head, forward)
    engine = DistillEngine(head, tc, autocast=fam.autocast)
    loss_fn = fam.loss_fn()
    rng = random.Random(seed)
    stream, recent, out = list(sets["stream"]), [], []
    train_s, features_s, steps, tokens = 0.0, 0.0, 0, 0

    def step(recs: list) -> None:
        nonlocal train_s, features_s, steps, tokens
        t = time.perf_counter()
        batch = fam.batch(recs)  # the features, as the trainer's (kept: a replay reads them again)
        features_s += time.perf_counter() - t
        t = time.perf_counter()
        engine.train_batch(batch, loss_fn)
        train_s += time.perf_counter() - t
        steps += 1
        tokens += batch.n_tokens  # prompt + output, whatever the loss counts

    for i in range(0, max(checkpoints), arrive):
        chunk = stream[i:i + arrive]
        step(chunk)
        recent = (recent + chunk)[-REPLAY_BUFFER:]
        for _ in range(tc.replay_steps):
            step(take_budget(replay_pool(recent, (), 0.0, rng), tc.token_budget, tc.max_seq_len))
        seen = i + len(chunk)
        if seen in checkpoints:
            cand = fam.rebuild(engine.export_weights())
            row = {"variant": name, "records": seen, "train_s": train_s, "features_s": features_s, "steps": steps,
                   "tokens": tokens,
                   "ms_per_step": 1e3 * train_s / steps}
            for key in ("held_code", "held_general"):
                bound, greedy = both_scores(scorer, cand, sets[key])
                row[key] = paired_scores(bound, parent[key])
                row[f"{key}_greedy"] = paired_scores(greedy, parent[f"{key}_greedy"])
            _log(f"{name:9s} after {seen:4d} records: code {row['held_code']['diff']:+.4f} "
                 f"[{row['held_code']['lower']:+.4f}, {row['held_code']['upper']:+.4f}], general "
                 f"{row['held_general']['diff']:+.4f}; greedy code {row['held_code_greedy']['diff']:+.4f}, general "
                 f"{row['held_general_greedy']['diff']:+.4f}; {steps} steps in {train_s:.1f} s, "
                 f"features {features_s:.1f} s")
            out.append(row)
    return out


def run_head_adapt(cfg: OSDConfig, *, records: int, eval_prompts: int, checkpoints: Sequence[int], arrive: int,
                   variants: Sequence[str], seed: int) -> dict[str, Any]:
    """v1 (built here when the state dir has none), the sets, then each variant in turn."""
    from infra.drafts.layer import load_draft
    from infra.drafts.spec import warm_start_path
    from infra.redis.server import free_port
    from infra.target import load_target
    from pipeline.teacher.engine import teacher_for
    from pipeline.teacher.served_forward import served_forward
    from train.distill.ds_engine import init_distributed
    from train.online.family import HeadFamily
    from train.warm.layer import warm_start_family

    for v in variants:
        head_variant_config(cfg, v)  # unknown names fail before any work
    v1_dir = warm_start_path(cfg, "head")
    if not v1_dir.is_dir():
        _log(f"no head v1 at {v1_dir}: making it (`osd draft init --family head`)")
        warm_start_family(cfg, "head", out_dir=v1_dir, generate=teacher_for(cfg))
    loaded = load_target(cfg.model.target, cfg.model.for_training(), progress=True)
    sets = head_sets(cfg, loaded, max(records, max(checkpoints)), eval_prompts, teacher_for(cfg))
    forward, why = served_forward(cfg)
    _log(why)
    v1, _ = load_draft(str(v1_dir), loaded.model)
    scorer = HeadFamily(loaded.model, cfg.train, v1, forward)  # keeps the held-out records' features
    parent = {}
    for k in ("held_code", "held_general"):
        parent[k], parent[f"{k}_greedy"] = both_scores(scorer, v1, sets[k])
    v1_alpha = {k: mean_alpha(v) for k, v in parent.items()}
    _log(f"v1: code {v1_alpha['held_code']:.4f}, general {v1_alpha['held_general']:.4f}; greedy agreement code "
         f"{v1_alpha['held_code_greedy']:.4f}, general {v1_alpha['held_general_greedy']:.4f}")
    init_distributed(0, 1, "127.0.0.1", free_port(), cfg.train.device)
    rows = []
    for v in variants:
        rows += run_head_variant(cfg, v, loaded, v1_dir, sets, scorer, parent, checkpoints, arrive, seed, forward)
    return {"family": "head", "v1_alpha": v1_alpha, "rows": rows, "records": len(sets["stream"]),
            "eval_records": {k: len(sets[k]) for k in ("held_code", "held_general")}, "features": why}
