"""The canary rule: routing hash, per-request evidence, the ratio estimator and its cluster
variance, the mSPRT interval, the decisions, the gate check, and by simulation the rule's
false-promotion rate for an equal draft and its power for a better one."""

import math
import random
import statistics
from pathlib import Path

import pytest

from pipeline.rollout.canary_rule import (
    Arm,
    CanaryRule,
    RatioStats,
    RequestSample,
    cs_radius,
    decide,
    gate_verdict,
    request_sample,
)
from serve.api.hot_swap import canary_share

pytestmark = pytest.mark.pure


def test_canary_share_is_deterministic_and_uniform():
    ids = [f"req-{i}" for i in range(20000)]
    assert [canary_share(i) for i in ids[:50]] == [canary_share(i) for i in ids[:50]]
    for w in (0.1, 0.5):
        frac = sum(canary_share(i) < w for i in ids) / len(ids)
        assert abs(frac - w) < 0.015
    assert all(0 <= canary_share(i) < 1 for i in ids)


def test_request_sample_hand_computed():
    # step 1: two drafts accepted, third rejected -> target token at pos 2
    # step 2: one accepted, then a bonus token with no draft judged (-1)
    # step 3: first draft rejected
    accepted = [True, True, False, True, False, False]
    drafts = [5, 6, 7, 8, -1, 9]
    s = request_sample(accepted, drafts)
    assert s == RequestSample(accepted=3, judged=5, tokens=6, steps=3)
    assert s.acceptance == pytest.approx(3 / 5) and s.mean_accepted_len == pytest.approx(6 / 3)
    assert request_sample([False, False], [-1, -1]) is None  # autoregressive: no evidence
    assert request_sample([], []) is None


def test_acceptance_is_a_ratio_of_sums_so_long_requests_weigh_by_their_tokens():
    arm = Arm()
    arm.add(RequestSample(accepted=0, judged=3, tokens=3, steps=3))  # short, nothing accepted
    arm.add(RequestSample(accepted=270, judged=300, tokens=400, steps=130))  # long, mostly accepted
    assert arm.acceptance.ratio == pytest.approx(270 / 303)  # not the mean of ratios, 0.45
    assert arm.mean_accepted_len.ratio == pytest.approx(403 / 133)
    assert arm.positions == 303 and arm.n == 2


def test_cluster_variance_is_the_delta_method_by_hand():
    pairs = [(3, 10), (10, 12), (1, 8), (20, 25)]
    s = RatioStats()
    for x, y in pairs:
        s.add(x, y)
    n = len(pairs)
    r = sum(x for x, _ in pairs) / sum(y for _, y in pairs)
    want = n / (n - 1) * sum((x - r * y) ** 2 for x, y in pairs) / sum(y for _, y in pairs) ** 2
    assert s.ratio == pytest.approx(r) and s.var() == pytest.approx(want)
    assert s.var(floor=1.0) == pytest.approx(1.0 / n)  # the floor bounds the per-request variance


def _request(rng, p_mean, sd=0.15):
    """A request on a prompt of its own difficulty (acceptance varies far more between prompts
    than between drafts), 10-80 drafted tokens, accepted count binomial (normal approximation)."""
    p = min(0.98, max(0.02, rng.gauss(p_mean, sd)))
    m = rng.randint(10, 80)
    a = round(min(m, max(0, m * p + math.sqrt(m * p * (1 - p)) * rng.gauss(0, 1))))
    steps = max(1, m - a)
    return RequestSample(a, m, a + steps, steps)


def test_cluster_variance_matches_the_spread_of_the_ratio_and_binomial_would_not():
    """Over many replicate arms the delta-method variance predicts the ratio's real spread;
    the binomial variance of positions, pretending tokens were independent, is far too small."""
    rng = random.Random(5)
    ratios, predicted, binomial = [], [], []
    for _ in range(400):
        s = RatioStats()
        for _ in range(60):
            r = _request(rng, 0.3)
            s.add(r.accepted, r.judged)
        ratios.append(s.ratio)
        predicted.append(s.var())
        binomial.append(s.ratio * (1 - s.ratio) / s.sy)
    real = statistics.variance(ratios)
    assert 0.8 < statistics.fmean(predicted) / real < 1.25
    assert statistics.fmean(binomial) < 0.5 * real


def test_radius_inverts_the_mixture_likelihood_ratio():
    for v, tau, alpha in ((0.01, 0.1, 0.05), (1e-4, 0.05, 0.01), (0.2, 0.4, 0.1)):
        r = cs_radius(v, tau, alpha)
        lam = math.sqrt(v / (v + tau**2)) * math.exp(r**2 * tau**2 / (2 * v * (v + tau**2)))
        assert lam == pytest.approx(1 / alpha, rel=1e-9)
    assert cs_radius(0.001, 0.1, 0.05) < cs_radius(0.01, 0.1, 0.05)  # more data, narrower


def _arm(rng, p_mean, n):
    a = Arm()
    for _ in range(n):
        a.add(_request(rng, p_mean))
    return a


def test_needs_min_requests_per_arm():
    rng = random.Random(0)
    d = decide(_arm(rng, 0.5, 50), _arm(rng, 0.0, 3), CanaryRule(min_requests=5))
    assert d.action == "continue" and "need 5" in d.reason


def test_clearly_worse_canary_rolls_back_and_clearly_better_promotes_at_the_last_step():
    rng = random.Random(1)
    rule = CanaryRule()
    bad = decide(_arm(rng, 0.5, 60), _arm(rng, 0.05, 12), rule)
    assert bad.action == "rollback" and "worse" in bad.reason
    assert bad.evidence["acceptance"]["upper"] < -rule.margin
    good = decide(_arm(rng, 0.3, 200), _arm(rng, 0.55, 100), rule, final=True)
    assert good.action == "promote" and good.evidence["acceptance"]["lower"] > rule.min_gain


def test_an_earlier_step_widens_on_non_inferiority_but_only_the_last_promotes():
    rng = random.Random(2)
    stable, canary = _arm(rng, 0.3, 200), _arm(rng, 0.55, 100)
    assert decide(stable, canary, CanaryRule(), final=False).action == "advance"
    # not worse, not surely better: widening is fine, promoting is not
    same = _fixed_arm([(5, 20), (7, 20)], 400)  # acceptance 0.3 with little spread: a narrow interval
    widen = decide(same, _fixed_arm([(5, 20), (7, 20)], 400), CanaryRule(), final=False)
    assert widen.action == "advance" and -CanaryRule().margin < widen.evidence["acceptance"]["lower"] < 0
    assert decide(same, _fixed_arm([(5, 20), (7, 20)], 400), CanaryRule(), final=True).action == "expire"


def _fixed_arm(pairs, n):
    """n requests cycling through (accepted, judged) pairs."""
    a = Arm()
    for i in range(n):
        acc, judged = pairs[i % len(pairs)]
        a.add(RequestSample(acc, judged, acc + judged - acc + 1, judged - acc + 1))
    return a


def test_a_better_point_estimate_inside_the_interval_expires_at_the_budget_and_never_promotes():
    rule = CanaryRule(max_requests=40)
    stable = _fixed_arm([(0, 20), (12, 20)], 40)  # acceptance 0.3, half the requests 0, half 0.6
    better = _fixed_arm([(0, 20), (14, 20)], 40)  # 0.35: +0.05, well inside a wide interval
    d = decide(stable, better, rule)
    assert d.evidence["acceptance"]["diff"] == pytest.approx(0.05)
    assert d.evidence["acceptance"]["lower"] < 0 < d.evidence["acceptance"]["upper"]
    assert d.action == "expire" and "point estimate is not evidence" in d.reason
    assert decide(stable, _fixed_arm([(0, 20), (14, 20)], 39), rule).action == "continue"


def test_min_gain_raises_the_bar_for_promotion():
    rng = random.Random(4)
    stable, canary = _arm(rng, 0.3, 300), _arm(rng, 0.4, 300)
    lower = decide(stable, canary, CanaryRule()).evidence["acceptance"]["lower"]
    assert lower > 0
    assert decide(stable, canary, CanaryRule()).action == "promote"
    assert decide(stable, canary, CanaryRule(min_gain=lower + 0.001)).action == "continue"


def test_continuous_monitoring_keeps_false_rollbacks_rare():
    """Equal arms, checked after every request: rollbacks must stay near or below alpha."""
    rng = random.Random(3)
    rule = CanaryRule(alpha=0.05, max_requests=10**9)
    rollbacks = 0
    runs = 200
    for _ in range(runs):
        s, c = Arm(), Arm()
        for i in range(150):
            for arm in (s, s, c):  # stable gets twice the traffic
                arm.add(_request(rng, 0.3))
            if decide(s, c, rule, final=False).action == "rollback":
                rollbacks += 1
                break
    assert rollbacks / runs <= 0.05


# -- simulation: false promotions of an equal draft, power for a better one ---------------------------


def simulate(delta: float, runs: int, seed: int, rule: CanaryRule, share: float = 0.5, base: float = 0.3,
             look_every: int = 10) -> dict:
    """The last canary step, as the controller runs it: requests routed to the canary with
    probability `share`, the canary's prompts `delta` easier to draft for, a look every
    `look_every` requests. Returns the rate of each outcome and the positions (draft tokens
    judged, both arms) each promotion needed."""
    rng = random.Random(seed)
    outcomes, positions = [], []
    for _ in range(runs):
        s, c = Arm(), Arm()
        i = 0
        while True:
            i += 1
            if rng.random() < share:
                c.add(_request(rng, base + delta))
            else:
                s.add(_request(rng, base))
            if i % look_every:
                continue
            d = decide(s, c, rule, final=True)
            if d.action != "continue":
                outcomes.append(d.action)
                if d.action == "promote":
                    positions.append(s.positions + c.positions)
                break
    return {**{a: outcomes.count(a) / runs for a in ("promote", "rollback", "expire")},
            "median_positions_to_promote": statistics.median(positions) if positions else None}


def test_an_equal_draft_is_promoted_under_5_percent_of_the_time():
    out = simulate(0.0, runs=200, seed=11, rule=CanaryRule())
    assert out["promote"] < 0.05
    assert out["expire"] > 0.9  # the budget ends it, with stable kept


def test_a_draft_better_by_0_05_is_promoted_most_of_the_time_within_the_budget():
    out = simulate(0.05, runs=200, seed=12, rule=CanaryRule())
    assert out["promote"] >= 0.7 and out["rollback"] == 0
    assert out["median_positions_to_promote"] > 1000  # a few noisy requests never suffice


def test_a_worse_draft_is_never_promoted():
    out = simulate(-0.05, runs=100, seed=13, rule=CanaryRule())
    assert out["promote"] == 0  # rolled back or expired: stable stays either way
    much_worse = simulate(-0.15, runs=100, seed=14, rule=CanaryRule())
    assert much_worse["promote"] == 0 and much_worse["rollback"] > 0.9


# -- the gate check (its evidence comes from train/gate/compare.py via the manifest) --------------------------


def _gate(stable="v1", lower=0.01, **kw):
    return {"stable": stable, "lower": lower, "upper": lower + 0.05, "passed": lower > 0, "reason": "r",
            "min_gain": 0.0, **kw}


def test_gate_verdict_admits_only_passing_evidence_against_the_current_stable():
    assert gate_verdict(_gate(), "v1")[0]
    missing = gate_verdict(None, "v1")
    assert not missing[0] and "no offline gate evidence" in missing[1]
    failing = gate_verdict(_gate(lower=-0.001), "v1")
    assert not failing[0] and "gate failed" in failing[1]
    # evidence against a parent (or a stable since replaced) is not evidence against stable
    stale = gate_verdict(_gate(stable="run-v0003"), "v1")
    assert not stale[0] and "against run-v0003, but stable is v1" in stale[1]
    # a `passed` flag without an interval above 0 is not trusted
    assert not gate_verdict(_gate(lower=0.0, passed=True), "v1")[0]
    assert not gate_verdict({"stable": "v1", "passed": True}, "v1")[0]


def _demo_rule() -> CanaryRule:
    from infra.config import load_config
    from pipeline.stack.profiles import demo_config

    ro = demo_config(load_config(), Path("/nonexistent-demo-state")).rollout
    return CanaryRule(alpha=ro.alpha, margin=ro.margin, min_requests=ro.min_requests, max_requests=ro.max_requests,
                      guard_requests=0)  # served evidence alone, as without the guard


def test_the_demos_smaller_budget_still_keeps_equal_draft_promotions_at_5_percent():
    """`make demo` gives a canary tens of requests, so it runs with a two-sided alpha of 0.1
    (promotion reads one side): an equal draft must still be promoted at most 5% of the time,
    looking after every other request, and a clearly better one (+0.1) most of the time."""
    rule = _demo_rule()
    assert rule.max_requests <= 100  # a budget the demo's ~14 minutes of traffic can reach
    equal = simulate(0.0, runs=400, seed=21, rule=rule, base=0.25, look_every=2)
    assert equal["promote"] <= 0.05
    better = simulate(0.1, runs=200, seed=22, rule=rule, base=0.25, look_every=2)
    assert better["promote"] > 0.7 and better["rollback"] < 0.02


# -- the guard: the offline gate's evidence of a gain, and a short canary that looks for harm ------------------


def test_with_a_guard_a_canary_without_harm_advances_then_is_promoted_after_the_budget():
    rng = random.Random(31)
    rule = CanaryRule(guard_requests=12, min_requests=6)
    stable, canary = _arm(rng, 0.3, 12), _arm(rng, 0.3, 11)
    assert decide(stable, canary, rule, final=True).action == "continue"  # 11 of 12
    canary.add(_request(rng, 0.3))
    d = decide(stable, canary, rule, final=True)
    assert d.action == "promote" and "no harm in 12 canary requests" in d.reason and "offline gate" in d.reason
    assert decide(stable, canary, rule, final=False).action == "advance"
    assert decide(stable, canary, CanaryRule(min_requests=6), final=True).action == "continue"  # no guard


def test_the_guard_still_rolls_back_a_much_worse_canary_within_its_budget():
    rule = CanaryRule(guard_requests=40)
    much_worse = simulate(-0.2, runs=100, seed=32, rule=rule)
    assert much_worse["rollback"] >= 0.8, much_worse
    equal = simulate(0.0, runs=100, seed=33, rule=rule)
    assert equal["rollback"] <= 0.05  # no harm, no rollback: the gate's evidence stands
