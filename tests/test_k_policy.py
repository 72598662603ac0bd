"""The cost rule for the draft length (serve/spec_decode/k_policy.py), on given cost profiles: it never
reads a clock here, so nothing below depends on the machine's speed."""

import pytest
import torch

from infra.target import build_tiny_llama
from serve.engine.core import GenerationParams, SpecEngine
from engine_options import small_options
from serve.spec_decode.k_policy import Acceptance, KPolicy, StepCosts, best_k, expected_tokens, profile_forward

pytestmark = pytest.mark.pure

# A bfloat16-like CPU profile (seconds by token count 1..5) and an int4-like one, whose verify
# grows fast with T.
FLAT = [0.030, 0.030, 0.031, 0.033, 0.034]
STEEP = [0.013, 0.0135, 0.015, 0.019, 0.0225]


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_no_draft_for_a_draft_that_is_never_accepted():
    for profile in (FLAT, STEEP):
        assert best_k(profile, draft_s=0.0, step_s=0.0, alpha=0.0, k_max=4) == 0


def test_a_perfect_free_draft_drafts_as_deep_as_the_profile_allows():
    assert best_k(FLAT, draft_s=0.0, step_s=0.0, alpha=1.0, k_max=4) == 4
    assert best_k(FLAT, draft_s=0.0, step_s=0.0, alpha=1.0, k_max=2) == 2  # the budget caps it
    assert best_k(FLAT[:3], draft_s=0.0, step_s=0.0, alpha=1.0, k_max=4) == 2  # and the profile


def test_steep_verify_and_costly_drafts_draft_less():
    flat = best_k(FLAT, draft_s=0.001, step_s=0.0, alpha=0.6, k_max=4)
    steep = best_k(STEEP, draft_s=0.001, step_s=0.0, alpha=0.6, k_max=4)
    costly = best_k(FLAT, draft_s=0.03, step_s=0.0, alpha=0.6, k_max=4)
    assert flat > steep >= 1
    assert costly == 0  # a draft token as dear as a target step cannot pay at alpha 0.6


def test_a_noisy_profile_is_read_through_its_lower_envelope():
    noisy = [0.013, 0.018, 0.0165, 0.019, 0.0225]  # T=2 measured dearer than T=3
    assert best_k(noisy, 0.0, 0.0, alpha=0.5, k_max=1) == 1  # costed as T=3's 16.5 ms, not 18


def test_the_choice_maximises_expected_tokens_per_second():
    for alpha in (0.1, 0.3, 0.5, 0.7, 0.9):
        for c in (0.0, 0.002, 0.01):
            k = best_k(STEEP, c, 0.001, alpha, 4)
            rates = [expected_tokens(alpha, j) / (STEEP[j] + j * c + 0.001) for j in range(5)]
            assert rates[k] == max(rates)


def test_a_request_leans_on_its_drafts_long_run_acceptance_and_forgets_while_idle():
    policy = KPolicy(StepCosts(list(FLAT), frozen=True), k_max=4)
    policy.by_draft["d"] = Acceptance(prior=0.6, weight=100.0)
    req = policy.start("d")
    assert req.alpha == pytest.approx(0.6)
    req.observe(2, 0)
    req.observe(2, 0)  # two early rejections move it, but do not decide the reply
    assert 0.3 < req.alpha < 0.6
    before = req.alpha
    req.own.fade()  # an idle step: old evidence fades towards the long-run figure
    assert before < req.alpha < 0.6


def test_acceptance_counts_reached_positions():
    a = Acceptance(prior=0.5, weight=0.0)
    a.observe(drafted=4, accepted=4, decay=1.0)  # all taken: 4 reached, 4 accepted
    a.observe(drafted=4, accepted=1, decay=1.0)  # 1 taken, rejected at the 2nd: 2 reached
    assert a.alpha == pytest.approx(5 / 6)
    a.observe(drafted=0, accepted=0)  # a step without drafts says nothing
    assert a.alpha == pytest.approx(5 / 6)


def test_frozen_costs_ignore_observations_and_live_ones_follow_them():
    frozen = StepCosts(list(FLAT), frozen=True)
    frozen.observe_verify(1, 1.0)
    frozen.observe_draft("d", 2, 1.0)
    assert frozen.verify_s == FLAT and frozen.draft_cost("d") == pytest.approx(0.1 * FLAT[0])
    live = StepCosts(list(FLAT))
    for _ in range(50):
        live.observe_verify(2, 0.05)
        live.observe_draft("d", 2, 0.01)
    assert live.verify_s[1] == pytest.approx(0.05, rel=1e-3) and live.draft_cost("d") == pytest.approx(0.005, rel=1e-3)


def test_a_request_at_zero_probes_its_draft_now_and_then():
    policy = KPolicy(StepCosts(list(FLAT), frozen=True), k_max=4, probe_every=4)
    fresh = policy.start("new")
    first = fresh.choose(limit=10)
    assert first >= 1  # an unseen draft starts from alpha 0.5 and is tried
    for _ in range(30):
        fresh.observe(fresh.choose(limit=10), 0)
    assert fresh.alpha < 0.2 and fresh.shared.alpha < 0.5  # rejected every time: both fall from 0.5
    policy.by_draft["bad"] = Acceptance(prior=0.0, weight=50.0)  # what earlier requests learned
    req = policy.start("bad")
    choices = []
    for _ in range(12):
        k = req.choose(limit=10)
        choices.append(k)
        req.observe(k, 0)
    assert choices == [0, 0, 0, 1] + [0] * 7 + [1]  # a probe after 4 idle steps, then after 8
    for _ in range(600):
        req.observe(req.choose(limit=10), 0)
    assert req.idle_limit == 256  # rejected probes back off to the cap
    while not req.probing:
        req.choose(limit=10)
    assert policy.start("bad").idle_limit == 256  # the draft's next request keeps the back-off
    req.observe(1, 1)  # an accepted probe starts the count over
    assert req.idle_limit == 0 and policy.start("bad").idle_limit == 0
    assert req.choose(limit=0) == 0  # no room left: never drafts


def test_profile_forward_takes_medians_by_token_count():
    calls = []

    def forward(t):
        calls.append(t)
        return 0.01 * t

    assert profile_forward(forward, k_max=2, repeats=3) == [0.01, 0.02, 0.03]
    assert calls.count(1) == 4  # a warm-up and three timed
    assert len(profile_forward(forward, k_max=1)) == 2 and calls.count(1) == 10  # five by default


def test_profile_forward_covers_a_long_chain_sparsely_then_the_batch():
    """Rows up to k+1 each; then doubling to the longest chain alone (13 rows), then to the
    batch's rows; the rows between interpolated."""
    timed = set()

    def forward(t):
        timed.add(t)
        return float(t * t)  # curved: interpolation shows between the timed points

    got = profile_forward(forward, k_max=2, repeats=1, alone_rows=13, max_rows=40)
    assert sorted(timed) == [1, 2, 3, 6, 12, 13, 26, 40]
    assert len(got) == 40 and got[12] == 169.0 and got[39] == 1600.0
    assert got[3] == 9 + (36 - 9) / 3  # 4 rows: a third of the way from 3 to 6


def _engine(target, draft, k=4):
    eng = SpecEngine(target, draft, options=small_options(k=k, k_policy="cost", max_seq_len=96))
    eng._lengths = KPolicy(StepCosts(list(FLAT), default_draft_fraction=0.05, frozen=True), k)
    return eng


def test_engine_drafts_nothing_but_probes_with_a_useless_draft_and_stays_lossless():
    target = build_tiny_llama(seed=3, num_layers=2, max_positions=96)
    target.config.eos_token_id = None
    bad = build_tiny_llama(seed=77, num_layers=1, max_positions=96)
    prompt = [5, 17, 200, 3]
    ref = SpecEngine(target, options=small_options(max_seq_len=96)).generate(
        prompt, GenerationParams(max_new_tokens=48, capture=False))
    eng = _engine(target, bad)
    eng._lengths.by_draft[id(eng.draft)] = Acceptance(prior=0.0, weight=100.0)  # known to be useless
    r = eng.generate(prompt, GenerationParams(max_new_tokens=48, capture=False))
    assert r.output_ids == ref.output_ids
    assert r.stats.num_draft_tokens <= 2  # probes only: after 16 idle steps, then after 32


def test_engine_drafts_deep_with_the_target_as_its_own_draft():
    target = build_tiny_llama(seed=3, num_layers=2, max_positions=96)
    target.config.eos_token_id = None
    eng = _engine(target, target)
    r = eng.generate([5, 17, 200, 3], GenerationParams(max_new_tokens=40, capture=False))
    assert r.stats.acceptance_rate == 1.0
    assert r.stats.num_draft_tokens / r.stats.num_drafts > 3  # the prior 0.5 climbs to 1 and k to 4


def test_engine_profiles_the_target_once_on_first_use():
    target = build_tiny_llama(seed=3, num_layers=2, max_positions=96)
    eng = SpecEngine(target, target, options=small_options(k=3, k_policy="cost", max_seq_len=96))
    assert eng._lengths is None
    eng.generate([5, 17], GenerationParams(max_new_tokens=4, capture=False))
    policy = eng._lengths
    # Rows 1..k+1 (a request alone) and on to a full batch's verify rows: 2 slots x (k+1).
    assert policy is not None and len(policy.costs.verify_s) == 8 and all(v > 0 for v in policy.costs.verify_s)
    eng.generate([5, 17], GenerationParams(max_new_tokens=4, capture=False))
    assert eng._lengths is policy
    assert torch.get_num_threads() >= 1


def test_min_draft_drafts_every_step_whatever_the_rule_says():
    """A canary comparison needs served acceptance from both arms (serve/api/app.py sets it while a
    canary runs)."""
    target = build_tiny_llama(seed=3, num_layers=2, max_positions=96)
    target.config.eos_token_id = None
    bad = build_tiny_llama(seed=77, num_layers=1, max_positions=96)
    eng = _engine(target, bad)
    eng._lengths.by_draft[id(eng.draft)] = Acceptance(prior=0.0, weight=100.0)
    r = eng.generate([5, 17, 200, 3], GenerationParams(max_new_tokens=20, capture=False, min_draft=1))
    assert r.stats.num_drafts == r.stats.num_steps - 1  # every step but the last (no room for a draft)


def test_an_unknown_k_policy_is_refused_by_name():
    from serve.engine.core import EngineError

    with pytest.raises(EngineError, match="k_policy: Input should be .cost., .schedule. or .fixed."):
        small_options(k_policy="greedy")


def test_chain_cut_takes_what_pays_on_a_fake_profile():
    from serve.spec_decode.k_policy import chain_cut, chain_expected

    assert chain_expected([0.5, 0.5, 1.0]) == 0.5 + 0.25 + 0.25
    flat = [10.0] * 8  # extra rows free: every token with any chance pays
    assert chain_cut(flat, 0.0, 1, 0, [0.9, 0.5, 0.1]) == 3
    steep = [10.0 * t for t in range(1, 9)]  # a row costs a whole step: nothing short of certainty pays
    assert chain_cut(steep, 0.0, 1, 0, [0.9, 0.9]) == 0
    assert chain_cut(steep, 0.0, 1, 0, [1.0, 1.0]) == 0  # a tie goes to the shorter chain
    gentle = [10.0, 11.0, 12.0, 13.0, 14.0]  # 10% a row: the likely head of the chain pays, its tail not
    assert chain_cut(gentle, 0.0, 1, 0, [0.95, 0.9, 0.05, 0.05]) == 2
    # In a batch the rows are dearer and the others' tokens are at stake: the cut comes sooner.
    assert chain_cut(gentle, 0.0, 4, 3, [0.95, 0.9, 0.05, 0.05]) <= 2


def test_fixed_and_schedule_policies_plan_within_limits_and_minimums():
    from serve.spec_decode.k_policy import length_policy

    fixed = length_policy("fixed", 4, profile=lambda: pytest.fail("only the cost rule profiles"))
    a, b = fixed.start("d"), fixed.start("d", min_draft=2)
    assert fixed.plan([a, None, b], [10, 10, 1], 3) == [4, 0, 1]  # the limit caps even a minimum
    sched = length_policy("schedule", 5, profile=lambda: pytest.fail("only the cost rule profiles"))
    r = sched.start("d")
    assert sched.plan([r], [10], 1) == [5]
    r.observe(5, 2)  # a rejection: one less
    r.observe(4, 4)  # all accepted: two more, at most k
    assert sched.plan([r], [10], 1) == [5] and r.alpha == 0.5
    r.observe(5, 0)
    r.observe(0, 0)  # nothing drafted: nothing learned
    assert sched.plan([r], [10], 1) == [4]
    with pytest.raises(ValueError, match="unknown k_policy 'greedy'"):
        length_policy("greedy", 4, profile=lambda: [])


def test_the_cost_policy_sizes_a_lone_request_and_a_batch_with_its_minimum():
    policy = KPolicy(StepCosts(list(FLAT), frozen=True), k_max=4)
    policy.by_draft["bad"] = Acceptance(prior=0.0, weight=100.0)
    policy.by_draft["good"] = Acceptance(prior=0.95, weight=100.0)
    useless, good = policy.start("bad", min_draft=1), policy.start("good")
    assert policy.plan([policy.start("bad")], [10], 1) == [0]
    assert policy.plan([useless], [10], 1) == [1]  # its rule says 0; the canary's minimum says 1
    assert policy.plan([good, useless, None], [10, 10, 10], 3) == [4, 1, 0]


def test_only_the_policy_reads_k_policy_names():
    """The draft length is decided in one place: no module of serve/ but the policy's compares a
    value with a k_policy name."""
    import ast
    from pathlib import Path

    names = {"cost", "schedule", "fixed"}
    offenders = []
    for path in Path("serve").rglob("*.py"):
        if path.as_posix() == "serve/spec_decode/k_policy.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value in names for c in [node.left, *node.comparators]):
                offenders.append(f"{path}:{node.lineno}")
    assert offenders == []
