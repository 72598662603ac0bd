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
    # A fine-tuning learning rate, so a trained draft is refined rather than jolted. No replay
    # steps: batched serving brings more fresh records than the trainer can step on, and a replay
    # step costs as much as a fresh one.
    # A candidate every 24 records or minute: the sequential gate (train/gate/pending.py) holds
    # each back until the held-out records favour it, so frequent candidates cost no canary.
    # One record in 3 held out, so that evidence comes within minutes at demo traffic.
    # The trainer learns from the last half minute's traffic when it falls behind (train/online/lag.py).
    d["train"].update(num_workers=1, export_every_records=24, export_every_s=60, held_out_every=3,
                      warm_epochs=cfg.train.warm_epochs, replay_steps=0, lr=3e-4, max_lag_s=30.0)
    # A canary gets a few dozen requests here, not hundreds: promotion rests on the gate's paired
    # evidence, and the canary guards against harm for 20 requests (CanaryRule.guard_requests).
    # Where served acceptance alone decides (guard off), a two-sided alpha of 0.1 keeps an equal
    # draft's false promotions at 5% (tests/test_canary_rule.py's simulation at this budget).
    d["rollout"].update(canary_steps=[0.5, 1.0], min_requests=6, max_requests=80, alpha=0.1, poll_s=1.0,
                        guard_requests=20)
    return OSDConfig.model_validate(d)
