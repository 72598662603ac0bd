"""The offline gate (train/gate/compare.py, train/gate/evaluator.py, the trainer's export): a candidate is
scored against the current stable version on the same held-out records, and only a paired
interval above 0 lets it through."""

import random

import pytest
import torch

import numpy as np

from train.gate.compare import BOOTSTRAP, bootstrap_draws, gate, paired_interval

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]


# -- the paired statistic, on numbers whose answer is known -------------------------------------------


def test_the_statistic_is_per_position_and_pairs_cancel_record_difficulty():
    rng = random.Random(0)
    n_pos = [rng.randint(5, 60) for _ in range(40)]
    # records differ wildly in difficulty; the candidate is better by exactly 0.02 on each position
    stable = [n * rng.uniform(0.05, 0.9) for n in n_pos]
    cand = [s + 0.02 * n for s, n in zip(stable, n_pos)]
    ev = gate(cand, stable, n_pos, stable_version="v1")
    assert ev["diff"] == pytest.approx(0.02) and ev["lower"] == pytest.approx(0.02)  # no pair noise
    assert ev["passed"] and ev["stable"] == "v1" and ev["positions"] == sum(n_pos)
    assert ev["candidate_alpha"] - ev["stable_alpha"] == pytest.approx(0.02)
    assert ev["per_record"][0] == [pytest.approx(0.02 * n_pos[0]), n_pos[0]]


def test_an_equal_or_worse_candidate_fails_and_a_tie_is_not_a_pass():
    n_pos = [20] * 30
    base = [5.0 + (i % 7) for i in range(30)]
    tie = gate(base, base, n_pos, stable_version="v1")
    assert tie["lower"] == 0 and not tie["passed"] and "no evidence it beats v1" in tie["reason"]
    worse = gate([b - 1 for b in base], base, n_pos, stable_version="v1")
    assert not worse["passed"] and worse["upper"] < 0


def test_a_noisy_small_gain_is_not_enough_and_more_records_make_it_enough():
    def records(n, seed):
        rng = random.Random(seed)
        pos = [rng.randint(10, 50) for _ in range(n)]
        diffs = [p * (0.01 + rng.gauss(0, 0.15)) for p in pos]  # +0.01 per position, noisy per record
        return diffs, pos

    # 25 records rarely show +0.01 (about 5% of record sets, by the normal approximation)
    passes = sum(paired_interval(*records(25, seed), resamples=300)[1] > 0 for seed in range(40))
    assert passes <= 10
    many = paired_interval(*records(4000, 99), resamples=300)
    assert 0 < many[1] < 0.01 < many[2]


def test_interval_coverage_of_the_cluster_bootstrap():
    """Over replicate record sets with a known true gain, the 90% interval covers it about 90%."""
    rng = random.Random(3)
    covered, runs = 0, 150
    for _ in range(runs):
        pos = [rng.randint(5, 80) for _ in range(60)]
        diffs = [p * (0.03 + rng.gauss(0, 0.1)) for p in pos]
        _, lo, hi = paired_interval(diffs, pos, confidence=0.9, resamples=300, seed=rng.randrange(10**6))
        covered += lo <= 0.03 <= hi
    assert 0.8 <= covered / runs <= 0.97


def test_too_few_records_or_no_stable_fail_with_the_reason():
    few = gate([1.0] * 5, [0.0] * 5, [10] * 5, stable_version="v1", min_records=20)
    assert not few["passed"] and "5 held-out records, the gate needs 20" in few["reason"]
    alone = gate([], [], [], stable_version=None)
    assert not alone["passed"] and "no stable version" in alone["reason"]


def test_the_evidence_is_reproducible_from_the_stored_pairs():
    rng = random.Random(4)
    pos = [rng.randint(5, 40) for _ in range(30)]
    stable = [p * rng.random() for p in pos]
    cand = [s + p * rng.gauss(0.05, 0.05) for s, p in zip(stable, pos)]
    ev = gate(cand, stable, pos, stable_version="v1")
    again = paired_interval([d for d, _ in ev["per_record"]], [n for _, n in ev["per_record"]], seed=ev["seed"],
                            resamples=ev["resamples"], confidence=ev["confidence"])
    assert again == pytest.approx((ev["diff"], ev["lower"], ev["upper"]), abs=1e-5)


def _reference_draws(diffs, positions, resamples, seed):
    """The bootstrap as a slow loop, one resample at a time (the gate's method before numpy-v1)."""
    rng = random.Random(seed)
    n, out = len(diffs), []
    for _ in range(resamples):
        idx = rng.choices(range(n), k=n)
        den = sum(positions[i] for i in idx)
        out.append(sum(diffs[i] for i in idx) / den if den else 0.0)
    return out


def test_the_bootstrap_is_reproducible_by_seed_and_draws_what_the_slow_loop_draws():
    rng = random.Random(5)
    pos = [rng.randint(5, 60) for _ in range(50)]
    diffs = [p * (0.02 + rng.gauss(0, 0.1)) for p in pos]
    a = bootstrap_draws(diffs, pos, resamples=4000, seed=11)
    assert np.array_equal(a, bootstrap_draws(diffs, pos, resamples=4000, seed=11))  # same seed, same draws
    assert not np.array_equal(a, bootstrap_draws(diffs, pos, resamples=4000, seed=12))
    assert paired_interval(diffs, pos, seed=11) == paired_interval(diffs, pos, seed=11)
    # Another generator, the same distribution: the mean and spread of D over resamples agree with
    # the reference loop's within bootstrap noise (4000 draws: the means' standard error is sd/63).
    ref = np.asarray(_reference_draws(diffs, pos, 4000, seed=11))
    se = np.hypot(a.std(), ref.std()) / np.sqrt(4000)
    assert abs(a.mean() - ref.mean()) < 4 * se
    assert a.mean() == pytest.approx(sum(diffs) / sum(pos), abs=4 * a.std() / np.sqrt(4000))
    assert a.std() == pytest.approx(ref.std(), rel=0.1)
    assert np.quantile(a, [0.025, 0.975]) == pytest.approx(np.quantile(ref, [0.025, 0.975]), abs=0.25 * a.std())


def test_the_evidence_names_its_bootstrap_method():
    ev = gate([1.0] * 25, [0.5] * 25, [10] * 25, stable_version="v1")
    assert ev["bootstrap"] == BOOTSTRAP == "numpy-v1" and ev["seed"] == 0 and ev["resamples"] == 2000
    assert gate([], [], [], stable_version=None)["bootstrap"] == "numpy-v1"


# -- real drafts of the tiny target on its own records -------------------------------------------------

VOCAB = 259  # the tiny target's vocabulary; a top-k this wide makes the lower bound exact


@pytest.fixture(scope="module")
def records(tiny):
    from infra.prompts import Prompt
    from train.teacher.data import generate_teacher_records

    prompts = [Prompt(f"g{i}", f"gate question {i}?" * (1 + i % 3), "other", "train") for i in range(24)]
    return generate_teacher_records(tiny.model, tiny.tokenizer, prompts, max_new_tokens=8, top_k=VOCAB,
                                    progress=False)


@pytest.fixture(scope="module")
def drafts(tiny):
    """`good`: both of the tiny target's layers (the target itself); `weak`: its first layer only."""
    from infra.drafts.layer import DraftSpec, build_draft

    return {"good": build_draft(tiny.model, DraftSpec(num_layers=2)),
            "weak": build_draft(tiny.model, DraftSpec(num_layers=1))}


def test_per_record_scores_add_up_to_alpha_est(drafts, records):
    from train.gate.evaluator import estimate_alpha, per_record_acceptance

    scores = per_record_acceptance(drafts["weak"], records, 128)
    assert len(scores) == len(records) and all(n == len(r.output_ids) for (_, n), r in zip(scores, records))
    alpha = sum(s for s, _ in scores) / sum(n for _, n in scores)
    assert alpha == pytest.approx(estimate_alpha(drafts["weak"], records, 128), rel=1e-5)


def test_the_gate_admits_a_better_candidate_and_refuses_a_worse_or_equal_one(drafts, records):
    from train.gate.evaluator import gate_candidate

    better = gate_candidate(drafts["good"], drafts["weak"], "v1", records, 128)
    assert better["passed"] and better["lower"] > 0 and better["records"] == len(records)
    worse = gate_candidate(drafts["weak"], drafts["good"], "v1", records, 128)
    assert not worse["passed"] and worse["upper"] < 0
    equal = gate_candidate(drafts["weak"], drafts["weak"], "v1", records, 128)
    assert not equal["passed"]


def test_gate_records_are_the_newest_held_out_ones_whose_prompt_was_not_trained_on(records):
    from train.gate.evaluator import gate_records

    trained = {records[-1].prompt_ids.tobytes()}
    picked = gate_records(records, 5, trained)
    assert picked == records[-6:-1]  # newest first wins; the repeated prompt is skipped
    assert gate_records(records, 0) == []


# -- the trainer's export: evidence against the current stable, whatever the parent -----------------


class _Gated:
    """The trainer's exporter (train/online/export.py) with only what its gate reads (no Ray, no
    DeepSpeed, no stream): `gate(draft)` is the evidence a checkpoint's candidate gets."""

    def __init__(self, tiny, tmp_path, held_out, parent):
        from types import SimpleNamespace

        from infra.config import load_config
        from train.online.export import Exporter
        from train.online.family import per_record

        self.cfg = load_config(environ={}, overrides={
            "state_dir": str(tmp_path), "model": {"target": "tiny-random"},
            "train": {"gate": {"method": "bootstrap", "min_records": 10, "resamples": 300}}})
        msl = self.cfg.train.max_seq_len
        fam = SimpleNamespace(score=lambda draft, recs: per_record(draft, tiny.model, recs, msl))
        self.exporter, self.held_out = Exporter(self.cfg, fam, tiny.model, tmp_path / "run", parent), held_out

    def gate(self, draft):
        e = self.exporter
        return e._bootstrap(draft, self.held_out, set(), e._stable_version())[0]


def _worker(tiny, tmp_path, held_out, parent):
    return _Gated(tiny, tmp_path, held_out, parent)


def _publish(reg, draft, tmp_path, version, **kw):
    from infra.drafts.layer import DraftSpec, save_draft

    spec = DraftSpec(num_layers=draft.config.num_hidden_layers)
    save_draft(draft, spec, tmp_path / version, target_ref={"spec": "tiny-random"})
    return reg.publish(tmp_path / version, version, **kw)


def test_a_candidate_of_a_gated_parent_is_gated_against_the_current_stable(tiny, tmp_path, drafts, records):
    from infra.registry import Registry

    w = _worker(tiny, tmp_path, records, parent="t-v0001")
    reg = Registry.from_config(w.cfg)
    _publish(reg, drafts["weak"], tmp_path, "v1")
    reg.promote("v1")
    # the parent: far better than v1 on paper, but gated; its evidence must not carry over
    _publish(reg, drafts["good"], tmp_path, "t-v0001", metrics={"gate": {"stable": "v1", "passed": False}})
    ev = w.gate(drafts["weak"])  # the child is no better than the current stable
    assert ev["stable"] == "v1" and not ev["passed"] and ev["records"] == len(records)
    ev = w.gate(drafts["good"])
    assert ev["stable"] == "v1" and ev["passed"]
    # a new stable: the next export is judged against it, not against v1 or the parent
    _publish(reg, drafts["good"], tmp_path, "v2")
    reg.promote("v2")
    ev = w.gate(drafts["good"])
    assert ev["stable"] == "v2" and not ev["passed"]


def test_no_stable_version_means_no_pass(tiny, tmp_path, drafts, records):
    ev = _worker(tiny, tmp_path, records, parent=None).gate(drafts["good"])
    assert not ev["passed"] and "no stable version" in ev["reason"]


def test_an_unloadable_stable_means_no_pass(tiny, tmp_path, drafts, records):
    from infra.registry import Registry

    w = _worker(tiny, tmp_path, records, parent=None)
    reg = Registry.from_config(w.cfg)
    _publish(reg, drafts["weak"], tmp_path, "v1")
    reg.promote("v1")
    payload = reg.payload_dir(reg.get("v1")) / "draft.safetensors"
    payload.write_bytes(payload.read_bytes()[:-4] + b"\0\0\0\0")  # corrupt: the digest check refuses it
    ev = w.gate(drafts["good"])
    assert not ev["passed"] and "could not score the stable version" in ev["reason"]


def test_drafts_differ_as_built(drafts, records):
    """Sanity of the fixture the gate tests rely on: the weak draft is well below the target."""
    from train.gate.evaluator import estimate_alpha

    with torch.no_grad():
        assert estimate_alpha(drafts["weak"], records, 128) < estimate_alpha(drafts["good"], records, 128) - 0.05
