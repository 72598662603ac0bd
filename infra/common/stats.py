"""The one percentile of the platform's reports (the ops page, the load bench, replay): numpy's
linear interpolation between closest ranks, None for no values."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) of `values`, linear between closest ranks; None if empty."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))
