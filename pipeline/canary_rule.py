"""The canary decision rule and the gate check, as pure functions (no framework imports;
unit tested in ms).

Evidence. Each finished request of a draft version gives one `RequestSample` from its
record: draft tokens accepted, draft tokens the target judged, tokens emitted, target
forwards (steps). A rejection ends a step, so the drafts after it are never judged.

Metrics, each a ratio of sums over a version's requests in the window:
- acceptance = sum(accepted) / sum(judged): the per-position acceptance probability α of
  Leviathan et al., the quantity the trainer's estimate targets. As a ratio of sums a long
  request weighs by its drafted tokens; a mean of per-request ratios would let a 3-token
  request count as much as a 300-token one.
- mean accepted length = sum(tokens) / sum(steps): tokens per target forward (1 for AR).

Variance. Tokens of one request are correlated, requests are (close to) independent, so
the request is the cluster. For R = sum(x)/sum(y) over n requests the delta method gives

    Var(R) ~ n/(n-1) * sum_i (x_i - R y_i)^2 / (sum_i y_i)^2

which is the between-request variance of the residuals, not the binomial variance of
positions (that would pretend the tokens of one prompt were independent, and be far too
narrow). The two arms are independent samples, so Var(R_c - R_s) = Var(R_c) + Var(R_s).

Test. Canary and stable are compared over the same window (the weight step), so a shift in
the traffic mix moves both arms alike. The difference d = R_c - R_s gets a two-sided
always-valid confidence sequence from the normal-mixture sequential probability ratio test
(mSPRT; Robbins 1970, as used for A/B tests by Johari et al. 2017, "Peeking at A/B Tests"):
with a N(0, tau^2) mixture over the true difference and V = Var(d),

    Lambda = sqrt(V / (V + tau^2)) * exp(d^2 tau^2 / (2 V (V + tau^2)))

and the test rejects "no difference" when Lambda >= 1/alpha. Inverting gives the radius

    r = sqrt( 2 V (V + tau^2) / tau^2 * (ln(1/alpha) + 0.5 ln((V + tau^2) / V)) )

so d +- r may be checked after every request without inflating the error rate (V is a
plug-in estimate, so this holds asymptotically).

Decision, after at least `min_requests` in each arm:
- rollback when, for either metric, the whole interval lies below -margin;
- at the last step before full traffic (`final`): promote when the acceptance interval lies
  wholly above `min_gain`: evidence of improvement, not absence of harm;
- at an earlier step: advance to the next weight when both intervals lie above -margin
  (widening exposure needs only evidence the canary is not worse; promotion comes later);
- otherwise keep collecting; at `max_requests` canary requests in the step the canary
  expires: stable stays, because a point estimate is never evidence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

METRICS = ("acceptance", "mean_accepted_len")
VAR_FLOOR = 1e-4  # a handful of identical requests must not look infinitely certain


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


@dataclass
class Arm:
    """One version's requests in the current window."""

    acceptance: RatioStats = field(default_factory=RatioStats)
    mean_accepted_len: RatioStats = field(default_factory=RatioStats)

    def add(self, s: RequestSample) -> None:
        self.acceptance.add(s.accepted, s.judged)
        self.mean_accepted_len.add(s.tokens, s.steps)

    @property
    def n(self) -> int:
        return self.acceptance.n

    @property
    def positions(self) -> int:
        """Draft tokens judged: the positions the evidence rests on."""
        return int(self.acceptance.sy)

    def summary(self) -> dict[str, float]:
        return {"n": self.n, "positions": self.positions, "acceptance": self.acceptance.ratio,
                "mean_accepted_len": self.mean_accepted_len.ratio}


@dataclass(frozen=True)
class CanaryRule:
    alpha: float = 0.05  # error probability of each always-valid interval
    tau: float = 0.1  # mixture scale: the size of difference the test is most sensitive to
    margin: float = 0.02  # acceptance: roll back when surely worse by more than this
    len_margin: float = 0.1  # mean accepted length (tokens per step): the same
    min_gain: float = 0.0  # acceptance: promote only when surely better by more than this
    min_requests: int = 10  # per arm, before any decision
    max_requests: int = 400  # canary requests in one step; undecided then: expire


@dataclass(frozen=True)
class Decision:
    action: str  # "continue", "advance", "promote", "rollback" or "expire"
    reason: str
    evidence: dict


def cs_radius(var_of_diff: float, tau: float, alpha: float) -> float:
    """Half-width of the mSPRT always-valid confidence interval for a difference."""
    v = max(var_of_diff, 1e-12)
    t2 = tau * tau
    return math.sqrt(2 * v * (v + t2) / t2 * (math.log(1 / alpha) + 0.5 * math.log((v + t2) / v)))


def compare(stable: RatioStats, canary: RatioStats, rule: CanaryRule, scale: float = 1.0) -> dict[str, float]:
    """Ratio difference canary - stable with its always-valid interval; `scale` sizes tau and
    the variance floor to the metric."""
    floor = VAR_FLOOR * scale * scale
    v = canary.var(floor) + stable.var(floor)
    d = canary.ratio - stable.ratio
    r = cs_radius(v, rule.tau * scale, rule.alpha)
    return {"diff": d, "lower": d - r, "upper": d + r, "stable": stable.ratio, "canary": canary.ratio}


def decide(stable: Arm, canary: Arm, rule: CanaryRule, k: int = 4, final: bool = True) -> Decision:
    """One look at the evidence. `k` (the draft budget) scales the accepted-length metric;
    `final`: passing this step promotes (else it widens the canary's share)."""
    evidence: dict = {"stable": stable.summary(), "canary": canary.summary(), "rule": rule.__dict__,
                      "final_step": final}
    if stable.n < rule.min_requests or canary.n < rule.min_requests:
        return Decision("continue", f"need {rule.min_requests} requests per arm "
                                    f"(stable {stable.n}, canary {canary.n})", evidence)
    acc = compare(stable.acceptance, canary.acceptance, rule)
    length = compare(stable.mean_accepted_len, canary.mean_accepted_len, rule, scale=float(k))
    evidence.update(acceptance=acc, mean_accepted_len=length)
    margins = {"acceptance": (acc, rule.margin), "mean_accepted_len": (length, rule.len_margin)}
    how = f"always-valid interval, alpha {rule.alpha}"
    worse = [m for m, (c, mg) in margins.items() if c["upper"] < -mg]
    if worse:
        return Decision("rollback", f"canary worse than stable by more than the margin on {', '.join(worse)} "
                                    f"({how})", evidence)
    if final and acc["lower"] > rule.min_gain:
        return Decision("promote", f"canary acceptance better than stable by more than {rule.min_gain} "
                                   f"(interval [{acc['lower']:+.4f}, {acc['upper']:+.4f}]; {how})", evidence)
    if not final and all(c["lower"] > -mg for c, mg in margins.values()):
        return Decision("advance", f"canary not worse than stable by more than the margin on both metrics "
                                   f"({how}); wider share next", evidence)
    if canary.n >= rule.max_requests:
        return Decision("expire", f"undecided after {canary.n} canary requests "
                                  f"(acceptance interval [{acc['lower']:+.4f}, {acc['upper']:+.4f}]): "
                                  f"stable stays; a point estimate is not evidence", evidence)
    return Decision("continue", "interval still undecided", evidence)


def gate_verdict(gate: dict | None, stable_version: str) -> tuple[bool, str]:
    """Whether a candidate's offline gate evidence (manifest `metrics.gate`, train/gate.py)
    admits it to a canary against the *current* stable version. Missing, failing, or
    evidence against another version (a parent, or a stable since replaced) does not."""
    if not isinstance(gate, dict):
        return False, "no offline gate evidence in its manifest (only gated candidates are canaried)"
    against = gate.get("stable")
    if against != stable_version:
        return False, f"gate evidence is against {against or 'no version'}, but stable is {stable_version}"
    lower, gain = gate.get("lower"), gate.get("min_gain", 0.0)
    if not isinstance(lower, (int, float)) or not lower > max(float(gain or 0.0), 0.0):
        return False, f"gate failed: {gate.get('reason') or 'no interval above 0'}"
    return True, f"gate passed against {stable_version}: {gate.get('reason', '')}"
