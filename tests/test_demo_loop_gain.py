"""What the demo reports of the loop's gain: time to adapt, and the final draft against v1 frozen."""

import pytest

pytestmark = pytest.mark.pure


def test_minutes_to_first_promotion_counts_from_the_shift_only():
    from pipeline.traffic.demo import minutes_to_first_promotion

    decisions = [{"time": 50.0, "action": "promote", "version": "v2"},  # before the shift: general traffic
                 {"time": 130.0, "action": "start", "version": "v3"},
                 {"time": 400.0, "action": "promote", "version": "v4"},
                 {"time": 280.0, "action": "promote", "version": "v3"}]
    assert minutes_to_first_promotion(decisions, shift=100.0) == (3.0, "v3")
    assert minutes_to_first_promotion(decisions[:2], shift=100.0) == (None, None)
    assert minutes_to_first_promotion([], shift=100.0) == (None, None)


def test_the_bootstrap_median_is_reproducible_by_seed_and_holds_its_point():
    from pipeline.traffic.speed_checks import bootstrap_median

    diffs = [0.12, -0.03, 0.08, 0.21, 0.05, 0.0, 0.15, 0.09, -0.01, 0.11, 0.07, 0.3]
    a = bootstrap_median(diffs, seed=3)
    assert a == bootstrap_median(diffs, seed=3)
    assert a != bootstrap_median(diffs, seed=4)  # the draws differ with the seed
    assert a["lower"] <= a["median"] <= a["upper"] and a["lower"] < a["upper"]
    assert a["median"] == pytest.approx(0.085) and a["n"] == 12 and a["level"] == 0.95


def test_equal_differences_give_a_zero_width_interval_and_none_give_none():
    from pipeline.traffic.speed_checks import bootstrap_median

    assert bootstrap_median([0.2] * 7) == {"median": 0.2, "lower": 0.2, "upper": 0.2, "n": 7, "level": 0.95,
                                           "resamples": 2000, "seed": 0}
    assert bootstrap_median([]) is None


def test_the_bootstrap_mean_is_the_mean_with_an_interval_around_it():
    from pipeline.traffic.speed_checks import bootstrap_mean, bootstrap_median

    diffs = [0.12, -0.03, 0.08, 0.21, 0.05, 0.0, 0.15, 0.09, -0.01, 0.11, 0.07, 0.3]
    a = bootstrap_mean(diffs, seed=3)
    assert a == bootstrap_mean(diffs, seed=3) and "median" not in a
    assert a["mean"] == pytest.approx(sum(diffs) / 12) and a["lower"] < a["mean"] < a["upper"] and a["n"] == 12
    # one far prompt moves the mean, not the median: each figure is its own statistic
    far = diffs[:-1] + [3.0]
    assert bootstrap_mean(far)["mean"] > a["mean"] + 0.2
    assert bootstrap_median(far)["median"] == bootstrap_median(diffs)["median"]
    assert bootstrap_mean([0.2] * 5)["lower"] == pytest.approx(0.2) and bootstrap_mean([]) is None


def pair(prompt, ratio, version):
    return {"prompt": prompt, "ratio": ratio, "version": version}


def test_loop_contribution_pairs_prompts_served_by_the_versions_checked():
    from pipeline.traffic.speed_checks import loop_contribution

    final = {"pairs": [pair("a", 1.5, "v3"), pair("b", 1.2, "v3"), pair("c", 1.4, "v4"), pair("d", 1.1, "v3")]}
    frozen = {"version": "v1", "final_version": "v3", "skipped": None,
              # "b" went to a canary; "d" failed in the frozen check, so it has no pair there
              "pairs": [pair("a", 1.0, "v1"), pair("b", 1.3, "v4"), pair("c", 1.0, "v1")]}
    lc = loop_contribution(final, frozen)
    assert [(p["prompt"], p["diff"]) for p in lc["per_prompt"]] == [("a", 0.5)]
    assert lc["served_by_another_version"] == 2 and lc["median"] == 0.5 and lc["skipped"] is None
    assert lc["mean"] == 0.5 and lc["lower"] == lc["upper"] == pytest.approx(0.5) and lc["n"] == 1
    none = loop_contribution(final, dict(frozen, pairs=[pair("b", 1.3, "v4")]))
    assert none["skipped"] == "no prompt measured with both drafts" and "median" not in none and "mean" not in none


def test_the_loop_contribution_is_the_mean_of_the_prompts_differences_beside_their_median():
    from pipeline.traffic.speed_checks import loop_contribution

    final = {"pairs": [pair(p, r, "v3") for p, r in (("a", 1.5), ("b", 1.2), ("c", 1.3))]}
    frozen = {"version": "v1", "final_version": "v3", "skipped": None,
              "pairs": [pair(p, r, "v1") for p, r in (("a", 1.0), ("b", 1.2), ("c", 1.2))]}
    lc = loop_contribution(final, frozen)
    assert lc["mean"] == pytest.approx(0.2) and lc["median"] == pytest.approx(0.1)
    assert lc["lower"] <= lc["mean"] <= lc["upper"] and lc["n"] == 3
    assert loop_contribution(final, {"skipped": "why"}) == {"skipped": "why", "per_prompt": []}


def test_the_frozen_check_is_skipped_with_a_reason():
    from pipeline.traffic.speed_checks import frozen_skip_reason

    assert frozen_skip_reason("v1", "demo-v0004") is None
    assert "nothing was promoted" in frozen_skip_reason("v1", "v1")
    assert "garbage-collected" in frozen_skip_reason("v1", "demo-v0004", start_kept=False)
    assert "no stable version" in frozen_skip_reason(None, "demo-v0004")


class FakeRegistry:
    """The aliases and the alias writes frozen_check uses; `moved_to` plays a controller that
    promotes during the check."""

    def __init__(self, stable, canary=None, moved_to=None, refuse=()):
        self.stable, self.canary, self.moved_to, self.refuse, self.writes = stable, canary, moved_to, refuse, []

    def aliases(self):
        return {"stable": {"version": self.stable}, "canary": self.canary}

    def alias(self, name):
        return self.aliases()[name]

    def exists(self, version):
        return True

    def set_stable(self, version, reason=""):
        from infra.registry import RegistryError

        if version in self.refuse:
            raise RegistryError(f"cannot move stable to {version}")
        self.writes.append(version)
        self.stable = self.moved_to or version


class FakeLoop:
    url = "http://demo"

    def __init__(self, reg, decide_during=()):
        self.reg, self.decisions, self.later = reg, [{"action": "promote", "version": "v3"}], list(decide_during)

    @property
    def cfg(self):
        from infra.config import OSDConfig

        return OSDConfig()

    def controller_status(self):
        out = {"aliases": self.reg.aliases(), "decisions": list(self.decisions)}
        self.decisions += self.later
        self.later = []
        return out


@pytest.fixture
def served(monkeypatch):
    """The replica answers at once with whatever the fake registry names stable."""
    import pipeline.traffic.speed_checks as checks

    calls = []

    def speed(url, prompts, max_tokens, salt):
        calls.append(prompts)
        assert salt == "osd-demo-frozen"
        return {"pairs": [pair("a", 1.0, "v1")], "speedup_vs_ar": 1.0}

    monkeypatch.setattr(checks, "wait_until_served", lambda url, version, **kw: 0.5)
    monkeypatch.setattr(checks, "speed_check", speed)
    return calls


def test_the_frozen_check_measures_v1_then_puts_the_loop_s_stable_back(served):
    from pipeline.traffic.speed_checks import frozen_check

    reg = FakeRegistry("v3", canary={"version": "v4", "weight": 0.5})
    loop = FakeLoop(reg, decide_during=[{"action": "gated", "version": "v5", "reason": "not vs v1"}])
    out = frozen_check(loop, reg, ["p"], 8, "v1")
    assert reg.writes == ["v1", "v3"] and reg.stable == "v3" and served == [["p"]]
    assert out["restored"] and out["speedup_vs_ar"] == 1.0 and out["final_version"] == "v3"
    assert out["canary_during"] == "v4"
    assert [d["version"] for d in out["decisions_during"]] == ["v5"]


def test_the_frozen_check_leaves_a_promotion_the_controller_made_meanwhile(served):
    from pipeline.traffic.speed_checks import frozen_check

    reg = FakeRegistry("v3", moved_to="v4")
    out = frozen_check(FakeLoop(reg), reg, ["p"], 8, "v1")
    assert reg.writes == ["v1"] and reg.stable == "v4"
    assert (out["restored"], out["stable_after"]) == (False, "v4")


def test_a_registry_that_refuses_a_move_costs_the_frozen_check_only(served):
    from pipeline.traffic.speed_checks import frozen_check

    reg = FakeRegistry("v3", refuse=("v1",))
    out = frozen_check(FakeLoop(reg), reg, ["p"], 8, "v1")
    assert reg.writes == [] and served == [] and out["skipped"].startswith("could not make v1 stable (RegistryError")
    reg = FakeRegistry("v3", refuse=("v3",))  # v1 measured, but stable cannot go back
    out = frozen_check(FakeLoop(reg), reg, ["p"], 8, "v1")
    assert reg.writes == ["v1"] and served == [["p"]] and out["speedup_vs_ar"] == 1.0
    assert out["restored"] is False and "cannot move stable to v3" in out["restore_error"]


def test_the_frozen_check_moves_nothing_while_stable_is_still_v1(served):
    from pipeline.traffic.speed_checks import frozen_check

    reg = FakeRegistry("v1")
    out = frozen_check(FakeLoop(reg), reg, ["p"], 8, "v1")
    assert reg.writes == [] and served == [] and "nothing was promoted" in out["skipped"]
    assert out["speedup_vs_ar"] is None and out["pairs"] == []


def test_report_carries_time_to_adapt_and_the_loop_s_contribution():
    from pipeline.traffic.demo import PhaseRun, build_report

    decisions = [{"time": 3.0, "action": "promote", "version": "v2", "reason": "ok"},
                 {"time": 64.0, "action": "promote", "version": "v3", "reason": "ok"}]
    speed = {"speedup_vs_ar": 1.4, "pairs": [pair("a", 1.4, "v3"), pair("b", 1.5, "v3")]}
    frozen = {"version": "v1", "final_version": "v3", "skipped": None, "speedup_vs_ar": 1.1,
              "pairs": [pair("a", 1.1, "v1"), pair("b", 1.2, "v1")]}
    run = PhaseRun(t0=1.0, shift=4.0, speed=speed, samples=[], records=[], start_stable="v1", frozen=frozen,
                   controller={"decisions": decisions, "aliases": {"stable": {"version": "v3"}}})
    r = build_report(run, [], [], {"records": 0, "positions": 0, "versions": []}, general_s=1, code_s=1)
    assert r["minutes_to_first_promotion"] == pytest.approx(1.0) and r["first_promotion"] == "v3"
    assert r["speedup_vs_ar_frozen"] == 1.1 and r["speed_check_frozen"] is frozen and r["start_stable"] == "v1"
    lc = r["loop_contribution"]
    assert lc["median"] == pytest.approx(0.3) and lc["mean"] == pytest.approx(0.3) and lc["n"] == 2
    assert lc["lower"] == pytest.approx(0.3)
    assert r["promoted"] == ["v2", "v3"] and r["speedup_vs_ar"] == 1.4  # the old keys stay


def test_the_summary_prints_time_to_adapt_and_the_contribution_with_its_interval(capsys):
    from pipeline.traffic.demo import _print_loop_gain

    r = {"minutes_to_first_promotion": 6.5, "first_promotion": "v3", "speedup_vs_ar": 1.4,
         "speedup_vs_ar_frozen": 1.1,
         "speed_check_frozen": {"skipped": None, "version": "v1", "final_version": "v3", "canary_during": "v4",
                                "decisions_during": [{"action": "gated", "version": "v5", "reason": "not vs v1"}]},
         "loop_contribution": {"skipped": None, "mean": 0.25, "median": 0.3, "lower": 0.1, "upper": 0.4, "n": 11,
                               "level": 0.95, "served_by_another_version": 1},
         "drafting_one_request": {"final": {"draft_per_output": 0.8, "acceptance": 0.41,
                                            "steps_by_source": {"suffix": 40, "head": 3}},
                                  "frozen": {"draft_per_output": 0.6, "acceptance": 0.5}}}
    _print_loop_gain(r)
    out = capsys.readouterr().out
    assert "6.5 minutes from the shift to promoting v3" in out
    assert "final v3 vs frozen v1: 1.40x vs 1.10x" in out
    assert "mean over 11 prompts): +0.250, 95% bootstrap interval [+0.100, +0.400] (median +0.300)" in out
    assert "final vs frozen: 0.80 vs 0.60 draft tokens an output token, 0.410 vs 0.500 of them accepted" in out
    assert "drafting steps by source head 3, suffix 40 vs -" in out
    assert "canary v4 was live" in out and "1 speed measurements" in out and "gated v5 (not vs v1)" in out
    _print_loop_gain({"minutes_to_first_promotion": None, "speed_check_frozen": {"skipped": "stable is still v1"},
                      "loop_contribution": {"skipped": "stable is still v1"}})
    out = capsys.readouterr().out
    assert "no promotion after the shift" in out and "skipped, stable is still v1" in out


class RolloutLoop:
    """A loop whose rollout can be stopped; records the order of its calls with the registry's."""

    def __init__(self, log):
        self.log = log

    def stop_rollout(self):
        self.log.append("stop_rollout")


class CanaryRegistry:
    def __init__(self, canary, log):
        self.canary, self.log = canary, log

    def alias(self, name):
        assert name == "canary"
        return self.canary

    def clear_canary(self, *, expect):
        self.log.append(("clear_canary", expect))
        self.canary = None


def test_the_rollout_stops_before_an_undecided_canary_is_withdrawn():
    """When traffic ends the controller stops first (it cannot start the canary again), then the
    canary it left undecided is cleared, only if the alias still names it."""
    from pipeline.traffic.demo import end_rollout

    log = []
    reg = CanaryRegistry({"version": "demo-v0014", "weight": 0.5}, log)
    assert end_rollout(RolloutLoop(log), reg) == "demo-v0014"
    assert log == ["stop_rollout", ("clear_canary", "demo-v0014")] and reg.canary is None
    log.clear()
    assert end_rollout(RolloutLoop(log), CanaryRegistry(None, log)) is None
    assert log == ["stop_rollout"]


def test_the_report_names_the_canary_withdrawn_at_the_end(capsys):
    from pipeline.traffic.demo import PhaseRun, _print_loop_gain, build_report

    run = PhaseRun(t0=1.0, shift=4.0, speed={"speedup_vs_ar": None, "pairs": []}, samples=[], records=[],
                   controller={"decisions": [], "aliases": {"stable": {"version": "v1"}}},
                   withdrawn_canary="demo-v0014")
    r = build_report(run, [], [], {"records": 0, "positions": 0, "versions": []}, general_s=1, code_s=1)
    assert r["canary_withdrawn_at_end"] == "demo-v0014"
    _print_loop_gain(r)
    assert "canary demo-v0014 was undecided when traffic ended: withdrawn" in capsys.readouterr().out


def test_a_report_without_a_frozen_check_says_so():
    from pipeline.traffic.demo import PhaseRun, build_report

    run = PhaseRun(t0=1.0, shift=4.0, speed={"speedup_vs_ar": None, "pairs": []}, samples=[], records=[],
                   controller={"decisions": [], "aliases": {"stable": {"version": "v1"}}})
    r = build_report(run, [], [], {"records": 0, "positions": 0, "versions": []}, general_s=1, code_s=1)
    assert (r["minutes_to_first_promotion"], r["first_promotion"], r["speedup_vs_ar_frozen"]) == (None, None, None)
    assert r["loop_contribution"] == {"skipped": "not run", "per_prompt": []}


def test_osd_demo_defaults_fit_the_twenty_minute_run():
    from pipeline.cli import build_parser

    args = build_parser().parse_args(["demo"])
    assert (args.clients, args.general_seconds, args.code_seconds, args.speed_prompts) == (8, 120, 600, 48)
    assert build_parser().parse_args(["demo", "--clients", "3"]).clients == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--clients", "0"])


def test_the_frozen_check_moves_a_real_registry_s_stable_and_back(draft_dir, tmp_path, served):
    from infra.registry import Registry
    from pipeline.traffic.speed_checks import frozen_check

    reg = Registry((tmp_path / "reg").as_uri(), cache_dir=tmp_path / "cache")
    for name in ("v1", "v2", "v3"):
        reg.publish(draft_dir, name)
    reg.promote("v1", reason="warm start")
    reg.promote("v3", reason="canary passed")
    reg.set_canary("v2", 0.5)  # not decided by the controller, here
    out = frozen_check(FakeLoop(reg), reg, ["p"], 8, "v1")
    assert out["restored"] and out["canary_during"] == "v2" and served == [["p"]]
    assert reg.alias("stable")["version"] == "v3" and reg.alias("canary")["version"] == "v2"
    reg.promote("v2")
    reg.gc(keep_last=1)  # v1 is neither aliased nor among the newest
    assert "garbage-collected" in frozen_check(FakeLoop(reg), reg, ["p"], 8, "v1")["skipped"]


def test_trainer_lag_is_read_from_the_ops_summary_in_records_and_seconds_of_traffic():
    from pipeline.traffic.demo import trainer_lag

    summary = {"loop": {"stream": {"groups": [{"group": "rollout", "lag": 0, "pending": 0},
                                              {"group": "trainers", "lag": 12, "pending": 3}]},
                        "trainers": [{"component": "trainer-0", "skipped_stale": 5}]}}
    lag = trainer_lag(summary, "trainers", requests=600, seconds=600)
    assert lag == {"records": 12, "pending": 3, "requests_per_s": 1.0, "seconds_of_traffic": 12.0, "skipped_stale": 5}
    assert trainer_lag(None, "trainers", 10, 60)["records"] is None  # no summary: said, not guessed
    assert trainer_lag(summary, "trainers", 0, 60)["seconds_of_traffic"] is None


def test_the_speed_check_s_modes_and_checks_never_share_a_prefix_cache(monkeypatch):
    """Each prompt goes out twice (with and without speculation): with one cache_salt the second
    request would start from the first one's prefill, and a second check from the first's."""
    from types import SimpleNamespace

    import pipeline.traffic.speed_checks as checks

    sent = []

    def post(url, text, max_tokens, **extra):
        sent.append((text, extra["osd_speculate"], extra["cache_salt"]))
        return {"ok": True, "latency_s": 1.0, "tokens": 10, "version": "v1"}

    monkeypatch.setattr(checks, "post_chat", post)
    prompts = [SimpleNamespace(id=str(i), text=f"p{i}") for i in range(3)]
    checks.speed_check("http://x", prompts, 8, salt="a")
    checks.speed_check("http://x", prompts, 8, salt="b")
    assert len(sent) == 12
    salts = {(spec, check): {s for t, sp, s in sent[6 * i: 6 * i + 6] if sp == spec}
             for i, check in enumerate("ab") for spec in (True, False)}
    assert all(len(v) == 1 for v in salts.values())  # one salt per mode and check
    assert len(set().union(*salts.values())) == 4  # and no two share one


def full_pair(prompt, sd, ar, version):
    return {"prompt": prompt, "sd_tok_s": sd, "ar_tok_s": ar, "ratio": sd / ar, "version": version, "tokens": 64}


def test_merged_rounds_average_each_prompt_and_version():
    from pipeline.traffic.speed_checks import merge_checks

    one = {"pairs": [full_pair("a", 200.0, 100.0, "v3"), full_pair("b", 150.0, 100.0, "v3")], "speedup_vs_ar": 1.75}
    two = {"pairs": [full_pair("a", 120.0, 80.0, "v3"), full_pair("b", 90.0, 100.0, "v4")], "speedup_vs_ar": 1.2}
    m = merge_checks([one, two])
    got = {(p["prompt"], p["version"]): p for p in m["pairs"]}
    assert got[("a", "v3")]["ratio"] == pytest.approx((2.0 + 1.5) / 2) and got[("a", "v3")]["rounds"] == 2
    assert got[("a", "v3")]["ar_tok_s"] == pytest.approx(90.0)
    assert got[("b", "v3")]["rounds"] == 1 and got[("b", "v4")]["ratio"] == pytest.approx(0.9)  # a canary's pair stays its own
    assert m["speedup_vs_ar"] == pytest.approx(1.5) and m["rounds"] == 2 and m["round_speedups"] == [1.75, 1.2]
    assert merge_checks([{"pairs": [], "speedup_vs_ar": None}])["speedup_vs_ar"] is None


def test_a_check_keeps_what_each_speculative_request_drafted_and_sums_it_up(monkeypatch):
    from types import SimpleNamespace

    import pipeline.traffic.speed_checks as checks

    def post(url, text, max_tokens, **extra):
        spec = extra["osd_speculate"]
        drafted = {"p0": 40, "p1": 20}[text] if spec else 0
        return {"ok": True, "latency_s": 0.5, "tokens": 64, "version": "v3", "mean_accepted_len": None,
                "draft_tokens": drafted, "accepted_tokens": drafted // 4}

    monkeypatch.setattr(checks, "post_chat", post)
    prompts = [SimpleNamespace(id=str(i), text=f"p{i}") for i in range(2)]
    one = checks.speed_check("http://x", prompts, 64, salt="s")
    assert [(p["draft_tokens"], p["accepted_tokens"]) for p in one["pairs"]] == [(40, 10), (20, 5)]
    d = checks.drafting(one)
    assert d["draft_per_output"] == pytest.approx(60 / 128) and d["acceptance"] == pytest.approx(15 / 60)
    assert d["accepted_per_output"] == pytest.approx(15 / 128)
    assert checks.merge_checks([one, one])["pairs"][0]["draft_tokens"] == 40
    assert checks.drafting({"pairs": []}) is None and checks.drafting(None) is None
    none = checks.drafting({"pairs": [dict(one["pairs"][0], draft_tokens=0, accepted_tokens=0)]})
    assert none["draft_per_output"] == 0 and none["acceptance"] is None


def test_a_check_counts_its_drafting_steps_by_who_proposed_over_pairs_and_rounds(monkeypatch):
    """Each answer's osd field says which draft proposed its drafting steps (a hybrid's head or
    suffix draft); a check sums them, and merged rounds keep each prompt's mean."""
    from types import SimpleNamespace

    import pipeline.traffic.speed_checks as checks

    steps = {"p0": {"suffix": {"steps": 6, "drafted": 18, "accepted": 9}},
             "p1": {"suffix": {"steps": 2, "drafted": 4, "accepted": 1},
                    "head": {"steps": 3, "drafted": 3, "accepted": 1}}}

    def post(url, text, max_tokens, **extra):
        spec = extra["osd_speculate"]
        return {"ok": True, "latency_s": 0.5, "tokens": 64, "version": "v3", "mean_accepted_len": None,
                "draft_tokens": 10 if spec else 0, "accepted_tokens": 5 if spec else 0,
                "by_source": steps[text] if spec else {}}

    monkeypatch.setattr(checks, "post_chat", post)
    prompts = [SimpleNamespace(id=str(i), text=f"p{i}") for i in range(2)]
    one = checks.speed_check("http://x", prompts, 64, salt="s")
    assert [p["by_source"] for p in one["pairs"]] == [steps["p0"], steps["p1"]]
    assert checks.drafting(one)["steps_by_source"] == {"suffix": 8, "head": 3}
    two = dict(one, pairs=[dict(p, by_source={}) for p in one["pairs"]])  # a round with no drafting steps
    merged = checks.merge_checks([one, two])
    assert merged["pairs"][1]["by_source"]["head"]["steps"] == pytest.approx(1.5)
    assert checks.drafting(merged)["steps_by_source"] == {"suffix": pytest.approx(4), "head": pytest.approx(1.5)}


def test_an_answer_carries_its_drafting_steps_by_source_and_the_parser_reads_them():
    from types import SimpleNamespace

    from pipeline.traffic.replay import parse_response
    from serve.api.openai_protocol import drafted_by_source, osd_extension

    stats = SimpleNamespace(by_source={"head": [3, 3, 1], "suffix": [2, 7, 5]})
    got = drafted_by_source(stats)
    assert got == {"head": {"steps": 3, "drafted": 3, "accepted": 1},
                   "suffix": {"steps": 2, "drafted": 7, "accepted": 5}}
    result = {"draft_version": "v3", "acceptance_rate": 0.6, "mean_accepted_len": 1.5, "num_drafts": 5,
              "num_draft_tokens": 10, "num_accepted_tokens": 6, "record_id": None, "drafted_by_source": got}
    osd = osd_extension(result)
    assert osd["drafted_by_source"] == got
    assert osd_extension({k: v for k, v in result.items() if k != "drafted_by_source"})["drafted_by_source"] == {}
    answer = {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}], "osd": osd}
    assert parse_response(answer, chat=True)["drafted_by_source"] == got
    assert parse_response({"choices": [{"text": "hi"}]}, chat=False)["drafted_by_source"] == {}


def test_the_final_and_frozen_checks_run_final_frozen_frozen_final(monkeypatch):
    """Each round its own salt, v1 served in the middle two, the loop's stable in the outer two;
    the contribution pairs the merged rounds."""
    import pipeline.traffic.speed_checks as checks

    reg = FakeRegistry("v3")
    order = []

    def speed(url, prompts, max_tokens, salt):
        order.append((salt, reg.stable))
        return {"pairs": [full_pair("a", 150.0 if reg.stable == "v3" else 120.0, 100.0, reg.stable)],
                "speedup_vs_ar": None}

    monkeypatch.setattr(checks, "wait_until_served", lambda url, version, **kw: 0.5)
    monkeypatch.setattr(checks, "speed_check", speed)
    final, frozen = checks.final_and_frozen(FakeLoop(reg), reg, ["p"], 8, "v1")
    assert order == [("osd-demo-final-1", "v3"), ("osd-demo-frozen-1", "v1"), ("osd-demo-frozen-2", "v1"),
                     ("osd-demo-final-2", "v3")]
    assert final["rounds"] == 2 and frozen["rounds"] == 2 and reg.stable == "v3"
    assert checks.loop_contribution(final, frozen)["median"] == pytest.approx(0.3)


def test_no_second_final_round_unless_the_loop_s_stable_is_served_again(monkeypatch):
    import pipeline.traffic.speed_checks as checks

    reg = FakeRegistry("v3")
    salts = []
    monkeypatch.setattr(checks, "speed_check", lambda url, prompts, max_tokens, salt: salts.append(salt) or
                        {"pairs": [full_pair("a", 150.0, 100.0, reg.stable)], "speedup_vs_ar": 1.5})
    served = iter([0.5, None])  # v1 comes, the loop's stable does not come back in time
    monkeypatch.setattr(checks, "wait_until_served", lambda url, version, **kw: next(served))
    final, frozen = checks.final_and_frozen(FakeLoop(reg), reg, ["p"], 8, "v1")
    assert salts == ["osd-demo-final-1", "osd-demo-frozen-1", "osd-demo-frozen-2"]
    assert "rounds" not in final and final["speedup_vs_ar"] == 1.5 and final["max_tokens"] == 8
    salts.clear()
    final, frozen = checks.final_and_frozen(FakeLoop(FakeRegistry("v1")), FakeRegistry("v1"), ["p"], 8, "v1")
    assert salts == ["osd-demo-final-1"] and "nothing was promoted" in frozen["skipped"]


def test_the_batched_check_sends_each_mode_s_prompts_together_and_pairs_them(monkeypatch):
    """Every prompt of one mode is in flight at once (up to `clients`), then the other mode's;
    each prompt's two answers pair up, and each mode keeps its own cache salt."""
    import threading
    from types import SimpleNamespace

    import pipeline.traffic.speed_checks as checks

    lock, live, peak, sent = threading.Lock(), [0], {}, []
    gate = threading.Barrier(3)

    def post(url, text, max_tokens, **extra):
        spec = extra["osd_speculate"]
        with lock:
            live[0] += 1
            peak[spec] = max(peak.get(spec, 0), live[0])
            sent.append((text, spec, extra["cache_salt"]))
        gate.wait(timeout=5)  # three clients: all three of a mode's requests meet here
        with lock:
            live[0] -= 1
        return {"ok": True, "latency_s": 0.5 if spec else 1.0, "tokens": 10, "version": "v3"}

    monkeypatch.setattr(checks, "post_chat", post)
    prompts = [SimpleNamespace(id=str(i), text=f"p{i}") for i in range(3)]
    out = checks.batched_check("http://x", prompts, 8, "s", clients=3, on_first=False)
    assert peak == {True: 3, False: 3}  # a mode's three prompts in flight together
    assert [spec for _, spec, _ in sent] == [False] * 3 + [True] * 3
    assert {salt for _, spec, salt in sent if spec} == {"s-on"} and {salt for _, spec, salt in sent if not spec} == {"s-off"}
    assert [p["prompt"] for p in out["pairs"]] == ["0", "1", "2"] and out["speedup_vs_ar"] == 2.0
    assert out["clients"] == 3
    # the round's throughput: each mode's tokens over its own wall time (30 tokens, whatever the
    # requests' own latencies say), and their ratio
    tp = out["throughput"]
    assert tp["sd_tok_s"] > 0 and tp["ar_tok_s"] > 0
    assert out["round_ratios"] == [pytest.approx(tp["sd_tok_s"] / tp["ar_tok_s"])]
    assert checks.throughput_speedup(out) == pytest.approx(tp["ratio"]) and checks.throughput_speedup({}) is None


def test_a_batched_round_s_throughput_is_its_tokens_over_its_wall_time(monkeypatch):
    """A failed request's tokens do not count; a mode's seconds run from its first request out
    to its last answer in."""
    from types import SimpleNamespace

    import pipeline.traffic.speed_checks as checks

    clock = iter([0.0, 2.0, 10.0, 14.0])  # speculative: 2 s; autoregressive: 4 s
    monkeypatch.setattr(checks.time, "perf_counter", lambda: next(clock))

    def post(url, text, max_tokens, **extra):
        ok = not (extra["osd_speculate"] and text == "p1")
        return {"ok": ok, "latency_s": 1.0, "tokens": 10, "version": "v3"} if ok else {"ok": False, "latency_s": 1.0}

    monkeypatch.setattr(checks, "post_chat", post)
    prompts = [SimpleNamespace(id=str(i), text=f"p{i}") for i in range(3)]
    out = checks.batched_check("http://x", prompts, 8, "s", clients=3)
    assert out["throughput"] == {"sd_tok_s": 10.0, "ar_tok_s": 7.5, "ratio": pytest.approx(10.0 / 7.5)}
    assert len(out["pairs"]) == 2  # the failed request's prompt has no pair


def test_the_batched_rounds_give_their_own_contribution(monkeypatch):
    """Each round runs the batched check BATCHED_REPEATS times, modes' order alternating; the
    contribution is the difference of the two drafts' mean round throughput ratios, with the
    range over every pair of a final and a frozen round (not a bootstrap over prompts, which
    share their round)."""
    import pipeline.traffic.speed_checks as checks

    reg = FakeRegistry("v3")
    batched = []
    ratios = iter([1.5, 1.3, 1.2, 1.0, 1.1, 0.9, 1.7, 1.5])  # final-1 x2, frozen-1 x2, frozen-2 x2, final-2 x2

    def one(url, prompts, max_tokens, salt):
        return {"pairs": [full_pair("a", 150.0, 100.0, reg.stable)], "speedup_vs_ar": 1.5}

    def many(url, prompts, max_tokens, salt, clients, on_first=True):
        batched.append((salt, reg.stable, on_first))
        r = next(ratios)
        return {"pairs": [full_pair("a", 200.0 * r, 200.0, reg.stable)], "speedup_vs_ar": r, "clients": clients,
                "round_ratios": [r]}

    monkeypatch.setattr(checks, "wait_until_served", lambda url, version, **kw: 0.5)
    monkeypatch.setattr(checks, "speed_check", one)
    monkeypatch.setattr(checks, "batched_check", many)
    monkeypatch.setattr(checks, "BATCHED_REPEATS", 2)
    final, frozen = checks.final_and_frozen(FakeLoop(reg), reg, ["p"], 8, "v1", clients=8)
    assert batched == [("osd-demo-final-1-batched", "v3", True), ("osd-demo-final-1-batched-2", "v3", False),
                       ("osd-demo-frozen-1-batched", "v1", False), ("osd-demo-frozen-1-batched-2", "v1", True),
                       ("osd-demo-frozen-2-batched", "v1", True), ("osd-demo-frozen-2-batched-2", "v1", False),
                       ("osd-demo-final-2-batched", "v3", False), ("osd-demo-final-2-batched-2", "v3", True)]
    assert final["batched"]["clients"] == 8 and final["batched"]["round_ratios"] == [1.5, 1.3, 1.7, 1.5]
    assert frozen["batched"]["round_ratios"] == [1.2, 1.0, 1.1, 0.9]
    assert checks.throughput_speedup(final["batched"]) == pytest.approx(1.5)
    assert checks.throughput_speedup(frozen["batched"]) == pytest.approx(1.05)
    lc = checks.batched_contribution(final, frozen)
    assert lc["mean"] == pytest.approx(0.45) and lc["lower"] == pytest.approx(0.1) and lc["upper"] == pytest.approx(0.8)
    assert lc["served_by_another_version"] == 0
    with_canary = final["batched"]["pairs"] + [full_pair("b", 1.0, 1.0, "v4")]
    canary = dict(final, batched=dict(final["batched"], pairs=with_canary))
    assert checks.batched_contribution(canary, frozen)["served_by_another_version"] == 1
    assert checks.loop_contribution(final, frozen)["median"] == pytest.approx(0.0)
    assert checks.batched_contribution({"pairs": []}, {"skipped": None, "pairs": []})["skipped"] == "no batched check ran"
    assert checks.batched_contribution(final, {"skipped": "why"})["skipped"] == "why"
    no_rounds = {"skipped": None, "batched": {"pairs": []}}
    assert "no batched round" in checks.batched_contribution(final, no_rounds)["skipped"]

def test_the_batched_check_sends_only_the_speed_set_s_first_prompts(monkeypatch):
    """A round's one-request check sends every prompt; its batched checks the first
    BATCHED_PROMPTS, each BATCHED_REPEATS times in both modes."""
    from types import SimpleNamespace

    import pipeline.traffic.speed_checks as checks

    sent = []

    def post(url, text, max_tokens, **extra):
        sent.append((text, extra["cache_salt"]))
        return {"ok": True, "latency_s": 0.5, "tokens": 10, "version": "v3"}

    monkeypatch.setattr(checks, "post_chat", post)
    n = checks.BATCHED_PROMPTS + 5
    prompts = [SimpleNamespace(id=str(i), text=f"p{i}") for i in range(n)]
    out = checks.check_round("http://x", prompts, 8, "s", clients=2)
    one = [t for t, salt in sent if "batched" not in salt]
    batched = [t for t, salt in sent if "batched" in salt]
    assert sorted(one) == sorted(f"p{i}" for i in range(n) for _ in range(2)) and len(out["pairs"]) == n
    assert set(batched) == {f"p{i}" for i in range(checks.BATCHED_PROMPTS)}
    assert len(batched) == checks.BATCHED_PROMPTS * 2 * checks.BATCHED_REPEATS
    assert len(out["batched"]["pairs"]) == checks.BATCHED_PROMPTS
