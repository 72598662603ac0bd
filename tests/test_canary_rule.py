"""The canary rule: routing hash, per-request evidence, the mSPRT interval and the decisions."""

import math
import random

import pytest

from pipeline.canary_rule import (
    Arm,
    CanaryRule,
    RunningStats,
    cs_radius,
    decide,
    request_sample,
)
from serve.hot_swap import canary_share

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
    # step 2: one accepted, then all k accepted? no: bonus token with no draft judged (-1)
    # step 3: first draft rejected
    accepted = [True, True, False, True, False, False]
    drafts = [5, 6, 7, 8, -1, 9]
    acc, length = request_sample(accepted, drafts)
    assert acc == pytest.approx(3 / 5) and length == pytest.approx(6 / 3)
    assert request_sample([False, False], [-1, -1]) is None  # autoregressive: no evidence
    assert request_sample([], []) is None


def test_running_stats_match_textbook():
    xs = [0.1, 0.4, 0.35, 0.9, 0.0]
    s = RunningStats()
    for x in xs:
        s.add(x)
    m = sum(xs) / len(xs)
    assert s.mean == pytest.approx(m) and s.var == pytest.approx(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def test_radius_inverts_the_mixture_likelihood_ratio():
    for v, tau, alpha in ((0.01, 0.1, 0.05), (1e-4, 0.05, 0.01), (0.2, 0.4, 0.1)):
        r = cs_radius(v, tau, alpha)
        lam = math.sqrt(v / (v + tau**2)) * math.exp(r**2 * tau**2 / (2 * v * (v + tau**2)))
        assert lam == pytest.approx(1 / alpha, rel=1e-9)
    assert cs_radius(0.001, 0.1, 0.05) < cs_radius(0.01, 0.1, 0.05)  # more data, narrower


def _arm(rng, mean_acc, n, sd=0.15):
    a = Arm()
    for _ in range(n):
        acc = min(1.0, max(0.0, rng.gauss(mean_acc, sd)))
        a.add((acc, 1 + 4 * acc))
    return a


def test_needs_min_requests_per_arm():
    rng = random.Random(0)
    d = decide(_arm(rng, 0.5, 50), _arm(rng, 0.0, 3), CanaryRule(min_requests=5))
    assert d.action == "continue" and "need 5" in d.reason


def test_clearly_worse_canary_rolls_back_and_better_advances():
    rng = random.Random(1)
    rule = CanaryRule()
    bad = decide(_arm(rng, 0.5, 60), _arm(rng, 0.05, 12), rule)
    assert bad.action == "rollback" and "worse" in bad.reason
    assert bad.evidence["acceptance"]["upper"] < -rule.margin
    good = decide(_arm(rng, 0.3, 60), _arm(rng, 0.55, 30), rule)
    assert good.action == "advance" and good.evidence["acceptance"]["lower"] > -rule.margin


def _fixed_arm(values, n):
    a = Arm()
    for i in range(n):
        acc = values[i % len(values)]
        a.add((acc, 1 + 4 * acc))
    return a


def test_budget_rule_decides_when_the_interval_cannot():
    rule = CanaryRule(max_requests=40)
    stable = _fixed_arm([0.0, 0.6], 40)  # mean 0.3, sd 0.3: wide intervals at n=40
    tie = decide(stable, _fixed_arm([0.0, 0.6], 40), rule)
    assert tie.action == "advance" and "budget rule" in tie.reason
    slightly_worse = decide(stable, _fixed_arm([0.0, 0.5], 40), rule)  # -0.05: past the margin, inside the interval
    assert slightly_worse.action == "rollback" and "budget rule" in slightly_worse.reason
    assert decide(stable, _fixed_arm([0.0, 0.5], 39), rule).action == "continue"


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
                acc = min(1.0, max(0.0, rng.gauss(0.3, 0.15)))
                arm.add((acc, 1 + 4 * acc))
            if decide(s, c, rule).action == "rollback":
                rollbacks += 1
                break
    assert rollbacks / runs <= 0.05
