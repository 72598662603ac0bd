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
- with `guard_requests` (the loop's default): once the canary has served that many requests
  in the step without a rollback, it advances, or at the last step is promoted. The evidence
  of improvement is then the offline gate's (train/gate/compare.py: paired, on held-out
  records, always-valid), which the controller requires before any canary starts; the canary
  guards what offline scoring cannot see (a served acceptance or accepted length far below
  stable's) with a short budget, instead of waiting for served acceptance, which varies far
  more between prompts than between drafts, to prove the gain a second time;
- otherwise keep collecting; at `max_requests` canary requests in the step the canary
  expires: stable stays, because a point estimate is never evidence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infra.common.canary_stats import (  # noqa: F401  (re-exported: the rule's public names)
    LEN_MARGIN,
    MIN_GAIN,
    TAU,
    VAR_FLOOR,
    RatioStats,
    RequestSample,
    compare_ratios,
    cs_radius,
    request_sample,
)

METRICS = ("acceptance", "mean_accepted_len")


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
    tau: float = TAU  # mixture scale: the size of difference the test is most sensitive to
    margin: float = 0.02  # acceptance: roll back when surely worse by more than this
    len_margin: float = LEN_MARGIN  # mean accepted length (tokens per step): the same
    min_gain: float = MIN_GAIN  # acceptance: promote only when surely better by more than this
    min_requests: int = 10  # per arm, before any decision
    max_requests: int = 400  # canary requests in one step; undecided then: expire
    guard_requests: int = 0  # > 0: advance or promote after this many canary requests without a rollback


@dataclass(frozen=True)
class Decision:
    action: str  # "continue", "advance", "promote", "rollback" or "expire"
    reason: str
    evidence: dict


def compare(stable: RatioStats, canary: RatioStats, rule: CanaryRule, scale: float = 1.0) -> dict[str, float]:
    """Ratio difference canary - stable with its always-valid interval; `scale` sizes tau and
    the variance floor to the metric."""
    return compare_ratios(stable, canary, rule.tau, rule.alpha, scale)


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
    if rule.guard_requests and canary.n >= rule.guard_requests:
        why = (f"no harm in {canary.n} canary requests (no interval below -margin; {how}), on the offline "
               f"gate's paired evidence of a gain")
        return Decision("promote" if final else "advance", why + ("" if final else "; wider share next"), evidence)
    if canary.n >= rule.max_requests:
        return Decision("expire", f"undecided after {canary.n} canary requests "
                                  f"(acceptance interval [{acc['lower']:+.4f}, {acc['upper']:+.4f}]): "
                                  f"stable stays; a point estimate is not evidence", evidence)
    return Decision("continue", "interval still undecided", evidence)


def gate_verdict(gate: dict | None, stable_version: str) -> tuple[bool, str]:
    """Whether a candidate's offline gate evidence (manifest `metrics.gate`, train/gate/compare.py)
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
