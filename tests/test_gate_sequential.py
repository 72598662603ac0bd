"""The sequential gate: an always-valid paired interval the trainer may look at after every
held-out record (train/gate/compare.py sequential_gate), the candidate that waits for it
(train/gate/pending.py), and the exporter that publishes only what it favours (train/online/export.py)."""

from types import SimpleNamespace

import numpy as np
import pytest

from train.gate.compare import sequential_gate, sequential_interval
from train.gate.pending import MAX_RECORDS, Pending

pytestmark = pytest.mark.pure


def _records(rng, n, gain):
    """Per-record (candidate - stable summed acceptance, positions): the per-position difference
    varies between records (sd 0.08 around `gain`, as a head's gains vary between prompts)."""
    pos = rng.integers(20, 120, n)
    per_pos = gain + rng.normal(0, 0.08, n)
    return per_pos * pos, pos


def _first_pass(diffs, pos, start=10):  # train.gate.min_records
    """The number of records at the first look (after each record) whose lower bound is above 0."""
    for n in range(start, len(diffs) + 1):
        if sequential_interval(diffs[:n], pos[:n], alpha=0.05)[1] > 0:
            return n
    return None


def test_an_equal_candidate_looked_at_after_every_record_passes_at_most_at_the_configured_rate():
    rng = np.random.default_rng(0)
    runs = 200
    passed = sum(_first_pass(*_records(rng, 120, 0.0)) is not None for _ in range(runs))
    # alpha 0.05 two-sided: at most 2.5% pass on the upper side, however often it is looked at
    assert passed / runs <= 0.05, passed


def test_a_better_candidate_passes_within_tens_of_records():
    rng = np.random.default_rng(1)
    firsts = [_first_pass(*_records(rng, 120, 0.05)) for _ in range(100)]
    assert sum(f is not None for f in firsts) >= 95
    assert np.median([f for f in firsts if f is not None]) <= 40  # about 2 minutes of held-out demo traffic


def test_a_one_look_interval_is_narrower_than_the_always_valid_one():
    from train.gate.compare import paired_interval

    diffs, pos = _records(np.random.default_rng(2), 60, 0.02)
    d, lo, hi = sequential_interval(diffs, pos)
    d2, lo2, hi2 = paired_interval(diffs, pos, resamples=500)
    assert d == pytest.approx(d2) and lo < lo2 and hi > hi2  # the price of looking again


def test_the_evidence_says_better_worse_or_undecided_and_needs_min_records():
    ones = [50] * 30
    better = sequential_gate([30.0] * 30, [25.0] * 30, ones, stable_version="v1")
    assert better["passed"] and better["verdict"] == "better" and better["lower"] > 0
    worse = sequential_gate([25.0] * 30, [30.0] * 30, ones, stable_version="v1")
    assert not worse["passed"] and worse["verdict"] == "worse" and worse["upper"] < 0
    rng = np.random.default_rng(3)
    noisy = sequential_gate(list(25 + rng.normal(0, 3, 30)), [25.0] * 30, ones, stable_version="v1")
    assert noisy["verdict"] == "undecided" and not noisy["passed"]
    few = sequential_gate([30.0] * 3, [25.0] * 3, [50] * 3, stable_version="v1", min_records=8)
    assert few["verdict"] == "undecided" and "needs 8" in few["reason"]
    assert sequential_gate([], [], [], stable_version=None)["reason"] == "no stable version to compare with"
    with pytest.raises(ValueError):
        sequential_gate([1.0], [1.0, 2.0], [5], stable_version="v1")


def _rec(i):
    return SimpleNamespace(record_id=f"r{i}", prompt_ids=np.array([i], np.int32))


def test_a_pending_candidate_takes_only_records_that_arrive_after_it_is_frozen():
    p = Pending("c", None, 0.0)
    there = [_rec(i) for i in range(10)]
    chosen = p.new_records(there[-4:])
    p.add(chosen, [(1.0, 5)] * 4)
    p.pass_over(there)
    later = there + [_rec(10), _rec(11)]
    assert [r.record_id for r in p.new_records(later)] == ["r10", "r11"]
    assert p.new_records(later, usable=lambda r: r.record_id != "r10")[0].record_id == "r11"
    with pytest.raises(ValueError):
        p.add([_rec(12)], [])


def test_a_pending_candidate_holds_at_most_max_records_and_skips_records_stable_has_no_score_for():
    p = Pending("c", None, 0.0)
    many = [_rec(i) for i in range(MAX_RECORDS + 30)]
    take = p.new_records(many)
    assert len(take) == MAX_RECORDS and take[-1].record_id == many[-1].record_id
    p.add(take[:20], [(30.0, 50)] * 20)
    stable = {r.record_id: (25.0, 50) for r in take[:15]}
    ev = p.evidence("v1", stable, min_records=8)
    assert ev["records"] == 15 and ev["passed"] and ev["looks"] == 1


class _Family:
    """Scores a draft {"gain": g} at 25 + g per record of 50 positions, with record-to-record noise."""

    name = "layer"

    def __init__(self):
        self.rng = np.random.default_rng(4)
        self.calls, self.scored = 0, []  # records scored, and their scores, over every draft

    def rebuild(self, weights):
        return dict(weights)

    def score(self, draft, records):
        out = [(25.0 + draft["gain"] + float(self.rng.normal(0, 1)), 50) for _ in records]
        self.calls += len(records)
        self.scored += out
        return out


def _exporter(monkeypatch, stable="v1"):
    from infra.config import OSDConfig
    from train.online.export import Exporter

    cfg = OSDConfig.model_validate({"train": {"gate": {"min_records": 8, "records": 10}}})
    e = Exporter(cfg, _Family(), None, None, "v1")
    published = []
    monkeypatch.setattr(e, "_stable_version", lambda: stable)
    monkeypatch.setattr(e, "_stable_scores", lambda v, recs: {r.record_id: (25.0, 50) for r in recs})
    monkeypatch.setattr(e, "_publish", lambda version, draft, metrics, lineage: published.append(
        (version, metrics)) or {"version": version, **metrics})
    return e, published


def _export(e, version, gain, held):
    return e.export({"gain": gain}, [0.5], 12, version=version, held_out=held, trained_prompts=set(),
                    records_total=12, world_size=1)


def test_the_exporter_publishes_a_better_candidate_once_enough_held_out_records_arrive(monkeypatch):
    e, published = _exporter(monkeypatch)
    held = [_rec(i) for i in range(4)]
    assert _export(e, "t-v0001", 3.0, held) is None and e.pending.version == "t-v0001"  # 4 records: wait
    for i in range(4, 40):
        held.append(_rec(i))
        out = e.look(held, set())
        if out:
            break
    assert out and out["version"] == "t-v0001" and published[0][1]["gate"]["passed"]
    assert out["gate"]["records"] < 40 and out["seconds_to_evidence"] >= 0 and e.pending is None
    # Its α estimate is taken from the gate's scores of it: no scoring pass of its own.
    assert e.fam.calls == out["gate"]["records"]
    assert out["alpha_est_records"] == out["gate"]["records"]
    assert out["alpha_est"] == pytest.approx(sum(s for s, _ in e.fam.scored) / (50 * len(e.fam.scored)))


def test_the_exporter_drops_a_worse_candidate_and_replaces_an_undecided_one(monkeypatch):
    e, published = _exporter(monkeypatch)
    held = [_rec(i) for i in range(30)]
    assert _export(e, "t-v0001", -3.0, held) is None and e.pending is None
    assert e.counts["dropped_worse"] == 1
    assert _export(e, "t-v0002", 0.0, held[:3]) is None and e.pending.version == "t-v0002"
    assert _export(e, "t-v0003", 0.0, held[:3]) is None and e.pending.version == "t-v0003"
    assert e.counts["replaced_undecided"] == 1 and published == []
    assert e.look(held[:3], set()) is None  # no new record: nothing to judge


def test_without_a_stable_version_the_exporter_publishes_at_once(monkeypatch):
    e, published = _exporter(monkeypatch, stable=None)
    out = _export(e, "t-v0001", 0.0, [])
    assert out["version"] == "t-v0001" and published[0][1]["gate"]["stable"] is None and e.pending is None
    assert out["alpha_est"] is None and out["alpha_est_records"] == 0  # no held-out records: no estimate
    out = _export(e, "t-v0002", 0.0, [_rec(i) for i in range(30)])  # the newest gate.records (10) are scored
    assert out["alpha_est_records"] == e.fam.calls == 10
    assert out["alpha_est"] == pytest.approx(sum(s for s, _ in e.fam.scored) / 500)


def test_a_bad_gate_method_or_guard_is_refused_by_name():
    from infra.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"train\.gate\.method: Input should be 'sequential' or 'bootstrap'"):
        load_config(environ={}, overrides={"train": {"gate": {"method": "fast"}}})
    with pytest.raises(ConfigError, match=r"rollout\.guard_requests: Input should be greater than or equal to 0"):
        load_config(environ={}, overrides={"rollout": {"guard_requests": -1}})
    assert load_config(environ={}).train.gate.method == "sequential"
