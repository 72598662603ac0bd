"""The demo report lists the candidates the offline gate kept from users, with their evidence."""

import pytest

pytestmark = pytest.mark.pure


def test_report_lists_gated_and_expired_candidates_with_the_gate_numbers():
    from pipeline.traffic.demo import PhaseRun, build_report

    gate = {"stable": "v1", "records": 40, "positions": 900, "candidate_alpha": 0.18, "stable_alpha": 0.34,
            "diff": -0.16, "lower": -0.19, "upper": -0.13, "per_record": [[-1.0, 20]] * 40}
    decisions = [{"time": 5.0, "action": "gated", "version": "demo-v0002", "reason": "gate failed: worse",
                  "evidence": {"gate": gate}},
                 {"time": 6.0, "action": "gated", "version": "hand", "reason": "no offline gate evidence",
                  "evidence": {"gate": None}},
                 {"time": 7.0, "action": "expired", "version": "demo-v0003", "reason": "undecided"}]
    run = PhaseRun(t0=1.0, shift=4.0, speed={"speedup_vs_ar": None, "pairs": []},
                   controller={"decisions": decisions, "aliases": {"stable": {"version": "v1"}}},
                   samples=[], records=[])
    r = build_report(run, [], [], {"records": 0, "positions": 0, "versions": []}, general_s=1, code_s=1)
    assert r["expired"] == ["demo-v0003"] and r["promoted"] == [] and r["rolled_back"] == []
    first, second = r["gated"]
    assert first == {"version": "demo-v0002", "reason": "gate failed: worse", "stable": "v1", "records": 40,
                     "positions": 900, "candidate_alpha": 0.18, "stable_alpha": 0.34, "diff": -0.16,
                     "lower": -0.19, "upper": -0.13}
    assert second["version"] == "hand" and second["lower"] is None and "no offline gate" in second["reason"]
