"""The gate on drafting in batched steps (serve/spec_decode/draft_gate.py), fed made-up step
outcomes: it never reads a clock, so nothing here depends on the machine's speed."""

import pytest

from serve.spec_decode.draft_gate import BLOCK, EXPLORE, EXPLORE_MAX, MIN_PAIRS, DraftGate
from serve.spec_decode.k_policy import Acceptance, KPolicy, StepCosts
from serve.spec_decode.protocol import StepContext

pytestmark = pytest.mark.pure

WARM = (MIN_PAIRS + 1) * BLOCK  # steps of alternating blocks before the gate decides


def run(gate: DraftGate, steps: int, sequences: int, drafting_tok_s: float, plain_tok_s: float,
        speed=lambda i: 1.0) -> list[bool]:
    """`steps` steps of `sequences` requests, each kind making its rate's tokens in 0.05 s,
    times the machine's speed at step i."""
    kinds = []
    for i in range(steps):
        drafting = gate.allow(sequences)
        kinds.append(drafting)
        gate.observe(sequences, drafting, (drafting_tok_s if drafting else plain_tok_s) * 0.05 * speed(i), 0, 0.05)
    return kinds


def test_the_kinds_alternate_in_blocks_until_enough_pairs():
    kinds = run(DraftGate(), WARM + BLOCK, 16, 100.0, 100.0)
    assert kinds[:WARM] == ([True] * BLOCK + [False] * BLOCK) * (MIN_PAIRS // 2) + [True] * BLOCK


def exploring_gaps(kinds: list[bool], chosen: bool) -> list[int]:
    """Blocks from the start of `kinds` to its first block of the other kind, then between
    such blocks; every block must be all of one kind."""
    blocks = [kinds[i:i + BLOCK] for i in range(0, len(kinds), BLOCK)]
    assert all(len(set(b)) == 1 for b in blocks)
    at = [i for i, b in enumerate(blocks) if b[0] != chosen]
    return [at[0] + 1] + [b - a for a, b in zip(at, at[1:])] if at else []


@pytest.mark.parametrize("drafting_tok_s,plain_tok_s,expect", [(80.0, 100.0, False), (120.0, 100.0, True)])
def test_the_faster_kind_runs_and_the_other_one_more_rarely_while_the_choice_holds(drafting_tok_s, plain_tok_s,
                                                                                    expect):
    gate = DraftGate()
    run(gate, WARM, 16, drafting_tok_s, plain_tok_s)
    later = run(gate, 300 * BLOCK, 16, drafting_tok_s, plain_tok_s)
    gaps = exploring_gaps(later, expect)
    # one block in EXPLORE first, then twice as far apart each time, up to EXPLORE_MAX
    assert gaps[:3] == [EXPLORE, 2 * EXPLORE, 4 * EXPLORE] and set(gaps[3:]) == {EXPLORE_MAX}
    state = gate.state()["16"]
    assert state["drafting_vs_plain"] == pytest.approx(drafting_tok_s / plain_tok_s, rel=1e-3)
    assert state["explore_every"] == EXPLORE_MAX and state["explored"] == len(gaps)


def test_a_near_tie_keeps_drafting():
    gate = DraftGate()
    run(gate, WARM + BLOCK, 16, 99.0, 100.0)  # plain within the margin
    assert run(gate, EXPLORE * BLOCK, 16, 99.0, 100.0).count(True) == (EXPLORE - 1) * BLOCK


def test_the_machines_drift_is_not_taken_for_the_kinds():
    """The machine slows down by a third over the run while plain steps stay 10% faster than
    drafting ones at every moment: rates gathered at different times would favour the kind
    that runs least (its steps are older, from the faster machine); adjacent blocks do not."""
    gate = DraftGate()
    n = WARM + 40 * EXPLORE * BLOCK
    kinds = run(gate, n, 16, 90.0, 100.0, speed=lambda i: 1.0 - i / (3 * n))
    later = kinds[WARM + BLOCK:]
    assert later.count(True) <= len(later) // EXPLORE + BLOCK  # drafting only in exploring blocks


def test_it_follows_a_change_through_its_exploring_blocks():
    gate = DraftGate()
    run(gate, WARM + 100 * BLOCK, 16, 80.0, 100.0)  # long enough to explore at its slowest
    b = gate.buckets[DraftGate.bucket(16)]
    assert b.choice is False and b.explore_every == EXPLORE_MAX
    blocks = 0  # the draft starts to match (a repeated document, say)
    while b.choice is not True:
        run(gate, BLOCK, 16, 150.0, 100.0)
        blocks += 1
        assert blocks <= 2 * EXPLORE_MAX  # within two explorations at the slowest
    # the new choice explores at the base rate again, then slows down as before
    assert b.explore_every == EXPLORE
    later = run(gate, 4 * EXPLORE * BLOCK, 16, 150.0, 100.0)
    assert exploring_gaps(later, True)[:2] == [EXPLORE - 1, 2 * EXPLORE]


def test_batch_sizes_are_judged_apart():
    gate = DraftGate()
    run(gate, WARM + BLOCK, 16, 50.0, 100.0)  # drafting loses at 16 requests
    run(gate, WARM + BLOCK, 2, 150.0, 100.0)  # and pays at 2
    assert run(gate, BLOCK, 2, 150.0, 100.0) == [True] * BLOCK
    assert run(gate, BLOCK, 16, 50.0, 100.0) == [False] * BLOCK
    assert set(gate.state()) == {"2", "16"}


def test_steps_that_carry_prompt_rows_are_not_counted():
    gate = DraftGate()
    run(gate, WARM + BLOCK, 16, 80.0, 100.0)  # plain decoding is faster
    before = gate.state()["16"]
    for _ in range(4 * EXPLORE * BLOCK):  # drafting steps that happen to carry prompt chunks
        drafting = gate.allow(16)
        gate.observe(16, drafting, 40.0 if drafting else 5.0, 64, 0.05)
    after = gate.state()["16"]
    for key in ("drafting_tok_s", "plain_tok_s", "drafting_steps", "drafting_vs_plain"):
        assert after[key] == before[key]
    assert run(gate, BLOCK, 16, 80.0, 100.0) == [False] * BLOCK


def test_the_cost_policy_asks_the_gate_for_a_batch_only():
    policy = KPolicy(StepCosts([0.030, 0.030, 0.031, 0.033, 0.034], frozen=True), k_max=4, gate=DraftGate())
    policy.by_draft["good"] = Acceptance(prior=0.95, weight=100.0)
    good = [policy.start("good") for _ in range(3)]
    canary = policy.start("good", min_draft=1)  # batches of 2 and 3 requests share a bucket
    for _ in range(BLOCK):  # the first block may draft
        assert policy.plan(good, [10] * 3, 3) == [4, 4, 4] and not policy.gated
        policy.observe_step(3, 0, 0.03)
    # The second is held back: nothing but a request's own minimum.
    assert policy.plan(good[:2] + [canary], [10] * 3, 3) == [0, 0, 1] and policy.gated
    policy.observe_step(3, 0, 0.03)
    # A step the policy did not plan (none of its requests drafts) is not the gate's to count.
    steps = dict(policy.gate.state()["2"])
    policy.observe_step(3, 0, 0.03)
    assert policy.gate.state()["2"] == steps
    # A request alone is not gated, and leaves the gate's record of the batch untouched.
    steps = dict(policy.gate.state()["2"])
    assert policy.plan(good[:1], [10], 1) == [4] and not policy.gated
    policy.observe_step(1, 0, 0.01)
    assert policy.gate.state()["2"] == steps


def test_a_gated_step_keeps_a_suffix_draft_to_the_planned_length():
    from test_suffix_draft import _Seq

    from serve.spec_decode.suffix.draft import SuffixDraft

    motif = [5, 6, 7, 8, 9, 10, 11, 12]
    for gated, drafts in ((False, True), (True, False)):
        draft, seq = SuffixDraft(2048), _Seq(motif * 3 + motif[:2])  # its own text: a match ahead
        ctx = StepContext(0.0, 4, lambda s: 8, None, rows=2, seqs=2, gated=gated)
        before = draft.asked
        assert (draft.propose([seq], [0], ctx)[0].tokens.numel() > 0) is drafts
        assert (draft.asked > before) is drafts  # held back, it does not even look


def test_a_batched_engine_runs_both_kinds_of_step_and_stays_lossless():
    import torch
    from test_batching import tiny
    from test_suffix_draft import _prompts

    from engine_options import small_options
    from serve.engine.core import GenerationParams, SpecEngine
    from serve.spec_decode.specs import build_draft

    torch.set_num_threads(1)
    target = tiny(layers=2)
    opts = dict(k=4, max_seq_len=160, max_concurrency=4, prefill_chunk=16)
    ar = SpecEngine(target, None, options=small_options(**opts, k_policy="fixed"))
    eng = SpecEngine(target, build_draft("suffix", target), options=small_options(**opts, k_policy="cost"))
    params = GenerationParams(max_new_tokens=40)
    want = [r.output_ids for r in ar.generate_many(_prompts(), params)]
    for _ in range(2):  # the second round's answers are in the replica's index: chains to verify
        assert [r.output_ids for r in eng.generate_many(_prompts(), params)] == want
    (four,) = [v for k, v in eng._lengths.gate.state().items() if k == "4"]
    assert four["drafting_steps"] >= BLOCK and four["plain_steps"] >= BLOCK
    assert four["drafting_tok_s"] > 0 and four["plain_tok_s"] > 0


def test_the_gate_is_the_cost_rules_and_can_be_turned_off():
    from serve.spec_decode.k_policy import length_policy

    profile = lambda: [0.03, 0.03, 0.031]  # noqa: E731
    assert isinstance(length_policy("cost", 2, profile).gate, DraftGate)
    off = length_policy("cost", 2, profile, gate=False)
    off.by_draft["good"] = Acceptance(prior=0.95, weight=100.0)
    good = [off.start("good") for _ in range(2)]
    for _ in range(3 * BLOCK):  # never held back
        assert off.plan(good, [10, 10], 2) == [2, 2] and not off.gated
        off.observe_step(2, 0, 0.03)


def test_a_bad_draft_gate_setting_is_refused_by_name():
    from infra.config import ConfigError, load_config

    assert load_config(environ={"OSD_SERVE__DRAFT_GATE": "false"}).serve.draft_gate is False
    with pytest.raises(ConfigError, match="draft_gate"):
        load_config(environ={"OSD_SERVE__DRAFT_GATE": "sometimes"})
