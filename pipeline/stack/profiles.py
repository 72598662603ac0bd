"""Settings of the closed loop for a demo-sized run on a small machine: what `osd demo` runs
with, and what `osd bench adapt` replays offline (its online training settings)."""

from __future__ import annotations

from pathlib import Path

from infra.config import OSDConfig


def demo_config(cfg: OSDConfig, state: Path) -> OSDConfig:
    """The demo's settings on top of the user's: its own state dir, a fast export and rollout cadence."""
    d = cfg.model_dump(mode="json")
    d["state_dir"] = str(state)
    # The trainer shares the machine's cores with the replica here: one forward thread, as before.
    # Eight requests at a time, batched into shared steps: the demo's clients are eight.
    d["serve"].update(num_replicas=1, num_cpus_per_replica=1.0, max_concurrency=8,
                      forward_threads=d["serve"]["forward_threads"] or 1)
    d["stream"].update(redis_url="")
    # Every version of the run is kept: the report scores each, and the frozen check serves v1 again.
    d["registry"].update(uri="", keep_last=1000)
    # Records replayed (as the warm start's epochs do) at a fine-tuning learning rate, so a trained
    # draft is refined rather than jolted: without replay, a candidate's single pass over a few
    # dozen records left it no better than v1 (docs: "The demo"). One replay step after each new
    # one, not three: the trainer skips most of the demo's records as stale, and at equal trainer
    # time twice the records with one replay each learned more (`osd bench adapt --variants
    # three_replays base no_replay`, docs/benchmarks.md). A replay step reads the kept features,
    # so it costs the head's step, not the target's forward.
    # A candidate every 32 records or 90 s: the sequential gate (train/gate/pending.py) holds
    # each back until the held-out records favour it, so frequent candidates cost no canary; each
    # is scored on the newest 40 held-out records, then on every one that arrives.
    # One record in 8 held out: at the demo's batched traffic that is a few records a minute for the
    # gate, and scoring them (a head over the full vocabulary) does not starve the training.
    # The trainer learns from the last half minute's traffic when it falls behind (train/online/lag.py).
    d["train"].update(num_workers=1, export_every_records=32, export_every_s=90, held_out_every=8,
                      warm_epochs=cfg.train.warm_epochs, replay_steps=1, lr=3e-4, max_lag_s=30.0)
    d["train"]["gate"].update(records=40)
    # A canary gets a few dozen requests here, not hundreds: promotion rests on the gate's paired
    # evidence, and the canary guards against harm for 20 requests (CanaryRule.guard_requests).
    # Where served acceptance alone decides (guard off), a two-sided alpha of 0.1 keeps an equal
    # draft's false promotions at 5% (tests/test_canary_rule.py's simulation at this budget).
    d["rollout"].update(canary_steps=[0.5, 1.0], min_requests=6, max_requests=80, alpha=0.1, poll_s=1.0,
                        guard_requests=20)
    return OSDConfig.model_validate(d)
