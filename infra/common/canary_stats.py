"""The canary's estimators, as pure functions: one request's evidence from its record, the
ratio of sums with its cluster (delta-method) variance, and the always-valid interval of a
difference. The rollout controller (pipeline/rollout/canary_rule.py) decides with them, and the ops
page (serve/api/ops/stats.py) shows the same numbers, so both live here, below either.
The derivations are in pipeline/rollout/canary_rule.py's module doc.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

VAR_FLOOR = 1e-4  # a handful of identical requests must not look infinitely certain
# The canary rule's fixed parameters, shared with the ops page's view of its checks:
TAU = 0.1  # the sequential test's mixture scale: the size of difference it is most sensitive to
LEN_MARGIN = 0.1  # roll back when mean accepted length is surely worse by more (tokens per step)
MIN_GAIN = 0.0  # promote only when acceptance is surely better by more than this


@dataclass(frozen=True)
class RequestSample:
    """One request's evidence, as counts (ratios are taken over sums, per arm)."""

    accepted: int  # draft tokens the target accepted
    judged: int  # draft tokens the target judged (accepted + the rejection ending a step)
    tokens: int  # tokens emitted
    steps: int  # target forwards

    @property
    def acceptance(self) -> float:
        return self.accepted / self.judged

    @property
    def mean_accepted_len(self) -> float:
        return self.tokens / self.steps


def request_sample(accepted: Sequence[bool], draft_tokens: Sequence[int]) -> RequestSample | None:
    """The counts of one request from its record's per-position accepted flags and draft
    tokens (-1: no draft judged there); None if nothing was drafted."""
    n = len(accepted)
    n_acc = sum(1 for a in accepted if a)
    steps = n - n_acc  # each step ends with exactly one token of the target's
    rejected = sum(1 for a, d in zip(accepted, draft_tokens) if not a and d >= 0)
    judged = n_acc + rejected
    if judged == 0 or steps == 0:
        return None
    return RequestSample(n_acc, judged, n, steps)


@dataclass
class RatioStats:
    """Running sums for the ratio sum(x)/sum(y) over requests and its cluster (delta) variance."""

    n: int = 0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    syy: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        self.n += 1
        self.sx += x
        self.sy += y
        self.sxx += x * x
        self.syy += y * y
        self.sxy += x * y

    @property
    def ratio(self) -> float:
        return self.sx / self.sy if self.sy else 0.0

    def unit_var(self) -> float:
        """Per-request variance of the residuals x - R y, in units of the ratio (mean y = 1)."""
        if self.n < 2 or not self.sy:
            return 0.0
        r = self.ratio
        sq = max(self.sxx - 2 * r * self.sxy + r * r * self.syy, 0.0)  # sum of squared residuals
        ybar = self.sy / self.n
        return sq / (self.n - 1) / (ybar * ybar)

    def var(self, floor: float = 0.0) -> float:
        """Var(ratio) by the delta method, each request one cluster; `floor` bounds the unit variance."""
        return max(self.unit_var(), floor) / max(self.n, 1)


def cs_radius(var_of_diff: float, tau: float, alpha: float) -> float:
    """Half-width of the mSPRT always-valid confidence interval for a difference."""
    v = max(var_of_diff, 1e-12)
    t2 = tau * tau
    return math.sqrt(2 * v * (v + t2) / t2 * (math.log(1 / alpha) + 0.5 * math.log((v + t2) / v)))



def compare_ratios(stable: RatioStats, canary: RatioStats, tau: float, alpha: float,
                   scale: float = 1.0) -> dict[str, float]:
    """Ratio difference canary - stable with its always-valid interval; `scale` sizes tau and
    the variance floor to the metric."""
    floor = VAR_FLOOR * scale * scale
    v = canary.var(floor) + stable.var(floor)
    d = canary.ratio - stable.ratio
    r = cs_radius(v, tau * scale, alpha)
    return {"diff": d, "lower": d - r, "upper": d + r, "stable": stable.ratio, "canary": canary.ratio}
