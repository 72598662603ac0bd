"""The canary decision rule, as pure functions (no framework imports; unit tested in ms).

Evidence. Each finished request of a draft version gives one observation per metric,
computed from its record (`request_sample`):

- acceptance: accepted drafts / drafts the target judged. A rejection ends a step, so the
  drafts after it are never judged; this is the per-position acceptance probability α of
  Leviathan et al. and the quantity the trainer's estimate targets.
- mean accepted length: tokens emitted per target forward (1 for AR, up to k+1).

The request, not the token, is the unit: tokens of one request are correlated, requests
are (close to) independent.

Test. Canary and stable are compared on samples taken over the same window (the weight
step), so a shift in the traffic mix moves both arms alike. For each metric the difference
of means d = mean(canary) - mean(stable), with variance V = s_c^2/n_c + s_s^2/n_s, gets a
two-sided always-valid confidence sequence from the normal-mixture sequential probability
ratio test (mSPRT; Robbins 1970, as used for A/B tests by Johari et al. 2017, "Peeking at
A/B Tests"): with a N(0, tau^2) mixture over the true difference,

    Lambda = sqrt(V / (V + tau^2)) * exp(d^2 tau^2 / (2 V (V + tau^2)))

and the test rejects "no difference" when Lambda >= 1/alpha. Inverting gives the radius

    r = sqrt( 2 V (V + tau^2) / tau^2 * (ln(1/alpha) + 0.5 ln((V + tau^2) / V)) )

so d +- r may be checked after every request without inflating the error rate (the
variance is a plug-in estimate, so this holds asymptotically).

Decision, after at least `min_requests` in each arm:
- rollback when, for either metric, the whole interval lies below -margin (canary worse
  by more than the margin);
- advance (next weight, or promote after the last) when, for both metrics, the whole
  interval lies above -margin (canary not worse by more than the margin);
- otherwise keep collecting; at `max_requests` canary requests in the step the budget rule
  decides on the point estimates: advance if neither is below -margin, else roll back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

METRICS = ("acceptance", "mean_accepted_len")
VAR_FLOOR = 1e-4  # a handful of identical observations must not look infinitely certain


def request_sample(accepted: Sequence[bool], draft_tokens: Sequence[int]) -> tuple[float, float] | None:
    """(acceptance, mean accepted length) of one request from its record's per-position
    accepted flags and draft tokens (-1: no draft judged there); None if nothing was drafted."""
    n = len(accepted)
    n_acc = sum(1 for a in accepted if a)
    steps = n - n_acc  # each step ends with exactly one token of the target's
    rejected = sum(1 for a, d in zip(accepted, draft_tokens) if not a and d >= 0)
    judged = n_acc + rejected
    if judged == 0 or steps == 0:
        return None
    return n_acc / judged, n / steps


@dataclass
class RunningStats:
    """Welford's running mean and variance."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)

    @property
    def var(self) -> float:
        return self.m2 / (self.n - 1) if self.n > 1 else 0.0


@dataclass
class Arm:
    """One version's observations in the current window."""

    acceptance: RunningStats = field(default_factory=RunningStats)
    mean_accepted_len: RunningStats = field(default_factory=RunningStats)

    def add(self, sample: tuple[float, float]) -> None:
        self.acceptance.add(sample[0])
        self.mean_accepted_len.add(sample[1])

    @property
    def n(self) -> int:
        return self.acceptance.n

    def summary(self) -> dict[str, float]:
        return {"n": self.n, "acceptance": self.acceptance.mean, "mean_accepted_len": self.mean_accepted_len.mean}


@dataclass(frozen=True)
class CanaryRule:
    alpha: float = 0.05  # error probability of each always-valid interval
    tau: float = 0.1  # mixture scale: the size of difference the test is most sensitive to
    margin: float = 0.02  # acceptance: how much worse the canary may be
    len_margin: float = 0.1  # mean accepted length (tokens per step): how much worse
    min_requests: int = 10  # per arm, before any decision
    max_requests: int = 200  # canary requests in one step before the budget rule decides


@dataclass(frozen=True)
class Decision:
    action: str  # "continue", "advance" or "rollback"
    reason: str
    evidence: dict


def cs_radius(var_of_diff: float, tau: float, alpha: float) -> float:
    """Half-width of the mSPRT always-valid confidence interval for a difference of means."""
    v = max(var_of_diff, 1e-12)
    t2 = tau * tau
    return math.sqrt(2 * v * (v + t2) / t2 * (math.log(1 / alpha) + 0.5 * math.log((v + t2) / v)))


def compare(stable: RunningStats, canary: RunningStats, rule: CanaryRule, scale: float = 1.0) -> dict[str, float]:
    """Difference canary - stable with its always-valid interval; `scale` sizes tau to the metric."""
    v = max(canary.var, VAR_FLOOR * scale * scale) / max(canary.n, 1) + \
        max(stable.var, VAR_FLOOR * scale * scale) / max(stable.n, 1)
    d = canary.mean - stable.mean
    r = cs_radius(v, rule.tau * scale, rule.alpha)
    return {"diff": d, "lower": d - r, "upper": d + r, "stable": stable.mean, "canary": canary.mean}


def decide(stable: Arm, canary: Arm, rule: CanaryRule, k: int = 4) -> Decision:
    """One look at the evidence. `k` (the draft budget) scales the accepted-length metric."""
    evidence: dict = {"stable": stable.summary(), "canary": canary.summary(), "rule": rule.__dict__}
    if stable.n < rule.min_requests or canary.n < rule.min_requests:
        return Decision("continue", f"need {rule.min_requests} requests per arm "
                                    f"(stable {stable.n}, canary {canary.n})", evidence)
    acc = compare(stable.acceptance, canary.acceptance, rule)
    length = compare(stable.mean_accepted_len, canary.mean_accepted_len, rule, scale=float(k))
    evidence.update(acceptance=acc, mean_accepted_len=length)
    margins = {"acceptance": (acc, rule.margin), "mean_accepted_len": (length, rule.len_margin)}
    worse = [m for m, (c, mg) in margins.items() if c["upper"] < -mg]
    if worse:
        return Decision("rollback", f"canary worse than stable by more than the margin on {', '.join(worse)} "
                                    f"(always-valid interval, alpha {rule.alpha})", evidence)
    if all(c["lower"] > -mg for c, mg in margins.values()):
        return Decision("advance", f"canary not worse than stable by more than the margin on both metrics "
                                   f"(always-valid interval, alpha {rule.alpha})", evidence)
    if canary.n >= rule.max_requests:
        if all(c["diff"] >= -mg for c, mg in margins.values()):
            return Decision("advance", f"undecided after {canary.n} canary requests; point estimates within "
                                       f"the margin (budget rule)", evidence)
        return Decision("rollback", f"undecided after {canary.n} canary requests; a point estimate is below "
                                    f"the margin (budget rule)", evidence)
    return Decision("continue", "interval still straddles the margin", evidence)
