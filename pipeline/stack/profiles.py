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
    d["serve"].update(num_replicas=1, num_cpus_per_replica=1.0, max_concurrency=2,
                      forward_threads=d["serve"]["forward_threads"] or 1)
    d["stream"].update(redis_url="")
    d["registry"].update(uri="")
    # Few records per candidate at demo traffic: replay them (as the warm start's epochs do) at a
    # fine-tuning learning rate, so a trained draft is refined rather than jolted.
    # One record in 3 held out: at demo traffic (~0.2 requests/s) the gate's 20 records take
    # ~5 minutes to gather; at 1 in 10 the 14-minute run never gave a candidate enough.
    # The trainer learns from the last minute's traffic when it falls behind (train/online/lag.py).
    d["train"].update(num_workers=1, export_every_records=48, export_every_s=150, held_out_every=3,
                      warm_epochs=cfg.train.warm_epochs, replay_steps=3, lr=3e-4, max_lag_s=60.0)
    # A canary gets a few dozen requests here, not hundreds. Promotion looks at one side of the
    # interval only, so a two-sided alpha of 0.1 keeps an equal draft's false promotions at 5%
    # (4.75% in tests/test_canary_rule.py's simulation at this budget), with a budget the run
    # can reach.
    d["rollout"].update(canary_steps=[0.5, 1.0], min_requests=6, max_requests=80, alpha=0.1, poll_s=1.0)
    return OSDConfig.model_validate(d)
