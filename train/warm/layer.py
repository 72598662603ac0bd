"""`osd draft init`: the first draft, distilled offline from the target's own outputs.

1. Teacher records: the target greedily answers `train.warm_prompts` ShareGPT train prompts
   (batched), cached on disk per prompt in Arrow shards keyed by target digest + settings
   (train/teacher/store.py): the cache grows across runs, an interrupted run resumes, and
   `train.warm_budget_minutes` stops generation and trains on what the cache holds.
2. Draft: `train.draft_layers` target layers copied, embedding/norm/head shared and frozen.
3. Distillation: `train.warm_epochs` passes through the DistillEngine (one process, world
   size 1), packed to the token budget, with a progress bar. A checkpoint after every epoch
   (COMPLETE marker last) lets a rerun resume at the next epoch.
4. Publish v1 with lineage and the acceptance estimate before and after, measured on one
   teacher record in `held_out_every` that training never sees.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from infra.config import OSDConfig
from infra.drafts.spec import warm_start_path
from train.distill.objective import Objective
from train.teacher.sets import split_held_out, teacher_records, warm_budget_s, warm_prompts


def _log(msg: str) -> None:
    print(f"[osd draft init] {msg}", flush=True)


@dataclass
class _Epochs:
    """What the distillation passes produced, for the published metrics."""

    losses: list[float]
    tokens: int
    train_s: float


def warm_start_family(cfg: OSDConfig, family: str, **kw: Any) -> dict[str, Any]:
    """`osd draft init --family <family>` with the config's settings: the head (train/warm/
    head.py) or the layer draft (run_warm_start); `kw` (out_dir, progress, force,
    generate) goes to either."""
    if family == "head":
        from train.warm.head import run_head_warm_start

        return run_head_warm_start(cfg, **kw)
    return run_warm_start(cfg, **kw)


def run_warm_start(cfg: OSDConfig, *, out_dir: str | Path | None = None, progress: bool = True,
                   force: bool = False, generate: Any = None) -> dict[str, Any]:
    """Teacher records -> a draft of target layers -> distilled -> published as v1 (module doc)."""
    from infra.drafts.layer import build_draft
    from infra.drafts.spec import draft_spec_from_train
    from infra.target import load_target
    from train.gate.evaluator import estimate_alpha

    tc = cfg.train
    out_dir = Path(out_dir) if out_dir else warm_start_path(cfg)
    if out_dir.exists() and not force:
        _log(f"{out_dir} already exists (use --force to rebuild)")
        return json.loads((out_dir / "draft.json").read_text())
    t0 = time.perf_counter()
    loaded = load_target(cfg.model.target, cfg.model.for_training(), progress=progress)
    prompts = warm_prompts(cfg, tc.warm_prompts)
    train_recs, held, gen_s = _teacher_split(cfg, loaded, prompts, progress, generate)

    spec = draft_spec_from_train(tc)
    draft = build_draft(loaded.model, spec)
    alpha_before = estimate_alpha(draft, held, tc.max_seq_len)
    if alpha_before is None:
        _log(f"no held-out record among {len(prompts)} prompts (1 in train.held_out_every = {tc.held_out_every} "
             f"is held out): v1 is published without an acceptance estimate; give more prompts for one")
    _log(f"draft: the first {tc.draft_layers} layers of the target; acceptance estimate before "
         f"training {_estimate(alpha_before)}")

    engine, ckpt_dir, first_epoch = _resumable_engine(cfg, draft, train_recs, spec, force)
    epochs = _train_epochs(cfg, engine, train_recs, ckpt_dir, first_epoch, progress)
    out = _save_v1(cfg, loaded, spec, engine.export_weights(), out_dir, held=held, n_train=len(train_recs),
                   n_prompts=len(prompts), alpha_before=alpha_before, epochs=epochs, force=force)
    _log(f"published v1 at {out_dir}: acceptance estimate {_estimate(alpha_before)} -> {_estimate(out['alpha_est'])} "
         f"({time.perf_counter() - t0:.0f} s in all, {epochs.train_s:.0f} s training)")
    return {"version": "v1", "path": str(out_dir), "generate_s": gen_s, "train_s": epochs.train_s, **out}


def _estimate(alpha: float | None) -> str:
    return "n/a (no held-out record)" if alpha is None else f"{alpha:.3f}"


def _teacher_split(cfg: OSDConfig, loaded: Any, prompts: list, progress: bool,
                   generate: Any = None) -> tuple[list, list, float]:
    """(train records, held-out records, seconds spent getting them) for `prompts`."""
    tc = cfg.train
    _log(f"teacher outputs for {len(prompts)} ShareGPT train prompts, up to {tc.warm_max_new_tokens} tokens each")
    t_gen = time.perf_counter()
    records = teacher_records(cfg, loaded, prompts, progress=progress, generate=generate, budget_s=warm_budget_s(cfg))
    gen_s = time.perf_counter() - t_gen
    train_recs, held = split_held_out(records, tc.held_out_every)
    _log(f"{len(records)} teacher records ({gen_s:.1f} s; cached for next time): {len(train_recs)} train, "
         f"{len(held)} held out")
    return train_recs, held, gen_s


def _resumable_engine(cfg: OSDConfig, draft: torch.nn.Module, train_recs: list, spec: Any,
                      force: bool) -> tuple[Any, Path, int]:
    """A one-process DistillEngine on `draft`, resumed from this run's newest complete checkpoint
    unless `force`. Returns (engine, checkpoint dir, first epoch still to train)."""
    from infra.redis.server import free_port
    from train.distill.ds_engine import WARMUP_STEPS, DistillEngine, init_distributed

    tc = cfg.train
    init_distributed(0, 1, "127.0.0.1", free_port(), tc.device)
    engine = DistillEngine(draft, tc)
    # Checkpoints are keyed by everything that shapes the run, so a resume never mixes settings;
    # by the records trained on, not the prompts asked for: a budget may have answered fewer.
    run_key = hashlib.sha256(json.dumps({"prompts": [r.request_id for r in train_recs], "spec": spec.model_dump(),
                                         "loss": Objective().loss, "lr": tc.lr, "tokens": tc.warm_max_new_tokens,
                                         "budget": tc.token_budget, "warmup": WARMUP_STEPS},
                                        sort_keys=True).encode()).hexdigest()[:16]
    ckpt_dir = Path(cfg.state_dir) / "warm-start" / run_key / "checkpoints"
    resumed = engine.load_latest(ckpt_dir) if not force else None
    first_epoch = int(resumed["epoch"]) + 1 if resumed else 0
    if resumed:
        _log(f"resuming after epoch {first_epoch} from {resumed['tag']}")
    return engine, ckpt_dir, first_epoch


def _train_epochs(cfg: OSDConfig, engine: Any, train_recs: list, ckpt_dir: Path, first_epoch: int,
                  progress: bool) -> _Epochs:
    """Epochs first_epoch.. of train.warm_epochs, each a seeded shuffle packed to the token
    budget, with a checkpoint after each so a rerun resumes at the next epoch."""
    from tqdm import tqdm

    from train.distill.batching import pack, take_budget
    from train.distill.objective import distill_loss_fn

    tc = cfg.train
    # Teacher records carry no draft proposals, so every position counts.
    loss_fn = distill_loss_fn(positions="all")
    losses: list[float] = []
    tokens = 0
    t_train = time.perf_counter()
    for epoch in range(first_epoch, tc.warm_epochs):
        g = torch.Generator().manual_seed(epoch)
        order = [train_recs[i] for i in torch.randperm(len(train_recs), generator=g).tolist()]
        bar = tqdm(total=len(order), desc=f"epoch {epoch + 1}/{tc.warm_epochs}", unit="rec", disable=not progress)
        while order:
            take = take_budget(order, tc.token_budget, tc.max_seq_len)
            batch = pack(take, tc.max_seq_len)
            losses.append(engine.train_batch(batch, loss_fn))
            tokens += batch.n_tokens
            bar.update(len(take))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        bar.close()
        engine.save(ckpt_dir, {"epoch": epoch, "records_total": len(train_recs) * (epoch + 1)})
    return _Epochs(losses, tokens, time.perf_counter() - t_train)


def _save_v1(cfg: OSDConfig, loaded: Any, spec: Any, weights: dict[str, torch.Tensor], out_dir: Path, *,
             held: list, n_train: int, n_prompts: int, alpha_before: float | None, epochs: _Epochs,
             force: bool) -> dict[str, Any]:
    """The trained draft saved at out_dir with its metrics (acceptance after training on the
    held-out records) and lineage. Returns metrics and lineage together."""
    from infra.drafts.layer import draft_with_weights, save_draft, target_ref
    from train.gate.evaluator import estimate_alpha

    tc = cfg.train
    final = draft_with_weights(loaded.model, spec, weights)
    alpha_after = estimate_alpha(final, held, tc.max_seq_len)
    losses, tokens, train_s = epochs.losses, epochs.tokens, epochs.train_s
    metrics = {"alpha_est": alpha_after, "alpha_est_before": alpha_before,
               "loss_last": losses[-1] if losses else None, "held_out_records": len(held),
               "train_tokens_per_s": tokens / train_s if train_s > 0 and tokens else None}
    lineage = {"parent": None, "kind": "warm_start", "records_consumed": n_train * tc.warm_epochs,
               "prompts": n_prompts, "epochs": tc.warm_epochs, "loss": Objective().loss}
    save_draft(final, spec, out_dir, target_ref=target_ref(loaded), lineage=lineage, metrics=metrics,
               overwrite=force)
    return {**metrics, **lineage}
