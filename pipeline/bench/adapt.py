"""`osd bench adapt --family layer`: what keeps the first candidates after a domain shift from
scoring below their parent (issue 17, part 4). The head, the draft the loop trains by default
(`--family head`, the default), has its own module: pipeline/bench/adapt_head.py.

The online trainer's situation after the demo's shift, replayed offline and without Ray: the
warm-start draft v1 (trained on general ShareGPT) meets a stream of code records, a few at a
time, and each step is followed by `train.replay_steps` steps on records drawn again. After
`checkpoints` records the candidate is scored against v1 on the *same* held-out records, the
paired statistic of the offline gate (train/gate/compare.py), on two sets:
- held-out code prompts: did the candidate learn the new domain?
- held-out general prompts (v1's own held-out split): did it forget the old one?

Variants (each starts from v1 with the same seeded record order):
- `base`: the demo's settings (replay of recent records, lr warm-up);
- `low_lr`: a third of the learning rate;
- `warm_replay`: replay steps draw half their records from v1's warm-start data;
- `anchor`: the loss adds 0.5 x KL(parent || draft), the parent frozen.
The last two are this bench's own settings (Variant), not the trainer's (README, "After a
domain shift": warm replay did not pay, the anchor helped early and held the draft back later).

Records are teacher records (the target's own greedy answers) so every position counts, as in
the warm start; the served records' weighting by draft rejections is not replayed here.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from tabulate import tabulate

from infra.config import OSDConfig
from pipeline.bench.adapt_head import HEAD_VARIANTS, VariantError, mean_alpha, paired_scores

VARIANTS = ("base", "low_lr", "warm_replay", "anchor")


def _log(msg: str) -> None:
    print(f"[osd bench adapt] {msg}", flush=True)


@dataclass(frozen=True)
class Variant:
    """One variant's training: the config (its train section changed for low_lr) and this bench's
    own settings: the share of each replay step's records drawn from v1's warm-start records, and
    the weight of KL(parent || draft) added to the loss (they were train.warm_replay_fraction and
    train.anchor_kl)."""

    cfg: OSDConfig
    warm_replay_fraction: float = 0.0
    anchor_kl: float = 0.0


def variant_config(cfg: OSDConfig, name: str) -> Variant:
    """One variant on top of `cfg` (the demo's online settings)."""
    if name == "low_lr":
        return Variant(cfg.model_copy(update={"train": cfg.train.model_copy(update={"lr": cfg.train.lr / 3})}))
    if name == "warm_replay":
        return Variant(cfg, warm_replay_fraction=0.5)
    if name == "anchor":
        return Variant(cfg, anchor_kl=0.5)
    if name != "base":
        raise VariantError(f"unknown variant {name!r} for the layer draft; known: {', '.join(VARIANTS)}")
    return Variant(cfg)


def adapt_sets(cfg: OSDConfig, loaded: Any, records: int, eval_prompts: int) -> dict[str, list]:
    """Teacher records (cached): the code stream, held-out code, v1's warm-start train and held-out sets."""
    from infra.prompts import load_sharegpt, unique_texts
    from train.teacher.sets import split_held_out, teacher_records, warm_prompts

    sharegpt = load_sharegpt(cfg.data)
    warm = warm_prompts(cfg, cfg.train.warm_prompts, prompts=sharegpt)
    warm_ids = {p.id for p in warm}
    stream = unique_texts([p for p in sharegpt if p.split == "train" and p.domain == "code"
                           and len(p.text) <= 600 and p.id not in warm_ids])[:records]
    held_code = unique_texts([p for p in sharegpt if p.split == "held_out" and p.domain == "code"
                              and len(p.text) <= 600])[:eval_prompts]
    _log(f"teacher records: {len(stream)} code stream, {len(held_code)} held-out code, {len(warm)} warm-start")
    warm_train, warm_held = split_held_out(teacher_records(cfg, loaded, warm), cfg.train.held_out_every)
    return {"stream": teacher_records(cfg, loaded, stream), "held_code": teacher_records(cfg, loaded, held_code),
            "warm_train": warm_train, "held_general": warm_held}


def paired(candidate: Any, parent_scores: list, records: list, max_seq_len: int) -> dict[str, float]:
    """Candidate minus parent, per position, on the same records, with the gate's interval."""
    from train.gate.evaluator import per_record_acceptance

    return paired_scores(per_record_acceptance(candidate, records, max_seq_len), parent_scores)


def run_variant(cfg: OSDConfig, name: str, loaded: Any, v1_dir: Path, sets: dict[str, list],
                parent_scores: dict[str, list], checkpoints: Sequence[int], arrive: int, seed: int) -> list[dict]:
    """Train one variant from v1 over the stream; score at each checkpoint."""
    from infra.drafts.layer import load_draft
    from train.distill.batching import pack, take_budget
    from train.distill.ds_engine import DistillEngine
    from train.distill.objective import anchored_loss_fn, distill_loss_fn
    from train.online.replay import replay_pool
    from train.online.trainer import REPLAY_BUFFER

    variant = variant_config(cfg, name)
    tc = variant.cfg.train
    draft, _ = load_draft(str(v1_dir), loaded.model)
    loss_fn = distill_loss_fn(positions="all")
    if variant.anchor_kl > 0:
        parent, _ = load_draft(str(v1_dir), loaded.model)
        parent.eval().requires_grad_(False)
        loss_fn = anchored_loss_fn(loss_fn, parent, variant.anchor_kl)
    engine = DistillEngine(draft, tc)
    rng = random.Random(seed)
    stream, recent, out = list(sets["stream"]), [], []
    t0 = time.perf_counter()
    for i in range(0, max(checkpoints), arrive):
        chunk = stream[i:i + arrive]
        engine.train_batch(pack(chunk, tc.max_seq_len), loss_fn)
        recent = (recent + chunk)[-REPLAY_BUFFER:]
        for _ in range(tc.replay_steps):
            pool = replay_pool(recent, sets["warm_train"], variant.warm_replay_fraction, rng)
            engine.train_batch(pack(take_budget(pool, tc.token_budget, tc.max_seq_len), tc.max_seq_len), loss_fn)
        seen = i + len(chunk)
        if seen in checkpoints:
            cand = copy.deepcopy(engine.module).eval()
            row = {"variant": name, "records": seen, "train_s": time.perf_counter() - t0}
            for key in ("held_code", "held_general"):
                row[key] = paired(cand, parent_scores[key], sets[key], tc.max_seq_len)
            _log(f"{name:12s} after {seen:4d} records: code {row['held_code']['diff']:+.4f} "
                 f"[{row['held_code']['lower']:+.4f}, {row['held_code']['upper']:+.4f}], general "
                 f"{row['held_general']['diff']:+.4f}")
            out.append(row)
    return out


def run_adapt_bench(cfg: OSDConfig, *, records: int = 96, eval_prompts: int = 48,
                    checkpoints: Sequence[int] = (18, 48, 96), arrive: int = 2,
                    variants: Sequence[str] = VARIANTS, seed: int = 0, family: str = "layer",
                    json_path: str | Path | None = "reports/bench/adapt.json") -> dict[str, Any]:
    """The bench for the layer draft (this module) or the head (pipeline/bench/adapt_head.py),
    on the demo's online training settings; prints the table and writes `json_path`."""
    from infra.drafts.layer import load_draft
    from infra.drafts.spec import warm_start_path
    from infra.redis.server import free_port
    from infra.target import load_target
    from train.distill.ds_engine import WARMUP_STEPS, init_distributed
    from train.gate.evaluator import per_record_acceptance
    from pipeline.stack.profiles import demo_config
    from train.warm.layer import run_warm_start

    # The demo's online training settings (lr, replay, warm-up), the run this bench stands for;
    # v1's held-out split stays the warm start's own.
    online = demo_config(cfg, Path(cfg.state_dir)).train.model_copy(update={"held_out_every": cfg.train.held_out_every})
    cfg = cfg.model_copy(update={"train": online})
    if any(c % arrive for c in checkpoints):
        raise ValueError(f"checkpoints {list(checkpoints)} must be multiples of --arrive {arrive}")
    if family == "head":
        from pipeline.bench.adapt_head import run_head_adapt

        out = run_head_adapt(cfg, records=records, eval_prompts=eval_prompts, checkpoints=checkpoints,
                             arrive=arrive, variants=variants, seed=seed)
        out.update(checkpoints=list(checkpoints), arrive=arrive, lr=cfg.train.lr, replay_steps=cfg.train.replay_steps)
        return _finish(out, json_path)
    for v in variants:
        variant_config(cfg, v)  # unknown names fail before any work
    loaded = load_target(cfg.model.target, cfg.model.for_training(), progress=True)
    v1_dir = warm_start_path(cfg)
    if not v1_dir.is_dir():
        run_warm_start(cfg)
    sets = adapt_sets(cfg, loaded, max(records, max(checkpoints)), eval_prompts)
    v1, _ = load_draft(str(v1_dir), loaded.model)
    parent_scores = {k: per_record_acceptance(v1, sets[k], cfg.train.max_seq_len) for k in ("held_code", "held_general")}
    v1_alpha = {k: mean_alpha(v) for k, v in parent_scores.items()}
    _log(f"v1: code {v1_alpha['held_code']:.4f}, general {v1_alpha['held_general']:.4f}")
    init_distributed(0, 1, "127.0.0.1", free_port(), cfg.train.device)
    rows = []
    for v in variants:
        rows += run_variant(cfg, v, loaded, v1_dir, sets, parent_scores, checkpoints, arrive, seed)
    out = {"family": "layer", "v1_alpha": v1_alpha, "rows": rows, "records": len(sets["stream"]),
           "checkpoints": list(checkpoints), "arrive": arrive, "lr": cfg.train.lr,
           "replay_steps": cfg.train.replay_steps, "warmup_steps": WARMUP_STEPS,
           "eval_records": {k: len(sets[k]) for k in parent_scores}}
    return _finish(out, json_path)


def _finish(out: dict[str, Any], json_path: str | Path | None) -> dict[str, Any]:
    _print(out)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(out, indent=2) + "\n")
        _log(f"wrote {json_path}")
    return out


def _print(out: dict[str, Any]) -> None:
    def cell(x: dict[str, float]) -> str:
        return f"{x['diff']:+.4f} [{x['lower']:+.4f}, {x['upper']:+.4f}]"

    rows = [[r["variant"], r["records"], cell(r["held_code"]), cell(r["held_general"]),
             f"{r['held_code_greedy']['diff']:+.4f}" if "held_code_greedy" in r else "-",
             f"{r['ms_per_step']:.0f}" if "ms_per_step" in r else "-",
             f"{r['features_s']:.1f}" if "features_s" in r else "-"] for r in out["rows"]]
    print("\n" + tabulate(rows, headers=["variant", "records", "code - v1 [95% interval]", "general - v1",
                                         "greedy code - v1", "ms a step", "features s"],
                         disable_numparse=True, colalign=("left",) + ("right",) * 6))


# -- the command line: `osd bench adapt` -------------------------------------------------------

HELP = "after a shift to code: candidates vs v1 (paired) per training variant, head or layer draft"
ERRORS: tuple[type[Exception], ...] = (VariantError,)


def add_arguments(ba: argparse.ArgumentParser) -> None:
    ba.add_argument("--records", type=int, default=96, help="code records streamed to the trainer (default 96)")
    ba.add_argument("--eval-prompts", type=int, default=48, help="held-out code prompts scored (default 48)")
    ba.add_argument("--checkpoints", type=int, nargs="+", default=[18, 48, 96], help="score after these many records")
    ba.add_argument("--arrive", type=int, default=2, help="records per new-data step (default 2, demo traffic)")
    ba.add_argument("--family", choices=["head", "layer"], default="head",
                    help="the draft the loop trains: head (default, the demo's), or layer")
    ba.add_argument("--variants", nargs="+", default=None, choices=sorted(set(VARIANTS) | set(HEAD_VARIANTS)),
                    help=f"default: every one of the family's (head: {', '.join(HEAD_VARIANTS)}; layer: "
                         f"{', '.join(VARIANTS)})")
    ba.add_argument("--json", default="reports/bench/adapt.json", metavar="PATH")


def run(cfg: OSDConfig, args: argparse.Namespace) -> int:
    variants = args.variants or (HEAD_VARIANTS if args.family == "head" else VARIANTS)
    run_adapt_bench(cfg, records=args.records, eval_prompts=args.eval_prompts, checkpoints=tuple(args.checkpoints),
                    arrive=args.arrive, variants=tuple(variants), family=args.family, json_path=args.json)
    return 0
