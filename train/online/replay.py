"""What a replay step trains on: recently trained records, mixed with the warm start's own.

After a domain shift the trainer sees a few new records a minute and replays them
(`train.replay_steps`). Replaying only them fits the draft to a handful of prompts; mixing in
the warm-start teacher records (a fraction of each replay step's records: `osd bench adapt`'s
warm_replay variant; the trainer replays recent records only) keeps the old domain in every step.
"""

from __future__ import annotations

import random
from typing import Any, Sequence


def replay_pool(recent: Sequence[Any], warm: Sequence[Any], fraction: float, rng: random.Random) -> list[Any]:
    """A shuffled pool for one replay step (take_budget fills the step from its front): all of
    `recent`, plus warm records making up `fraction` of the pool (as far as `warm` has them)."""
    if not 0 <= fraction < 1:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")
    n_warm = min(len(warm), round(len(recent) * fraction / (1 - fraction))) if recent else 0
    if fraction > 0 and warm and not recent:
        n_warm = min(len(warm), 8)
    pool = list(recent) + (rng.sample(list(warm), n_warm) if n_warm else [])
    rng.shuffle(pool)
    return pool
