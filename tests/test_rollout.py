"""The canary controller against a real Redis stream and a file:// registry (synthetic records):
the offline gate before any canary, then the canary rule's promote / rollback / expire."""

import random

import numpy as np
import pytest

from infra.records.schema import Record
from infra.registry import Registry
from pipeline.rollout.controller import CanaryController
from infra.records.streams import RecordProducer

pytestmark = [pytest.mark.usefixtures("one_thread")]
redis = pytest.mark.redis  # every test but the metrics one reads a real stream


def _cfg(tmp_path, redis_url, **rollout):
    from infra.config import load_config

    return load_config(environ={}, overrides={
        "state_dir": str(tmp_path), "stream": {"redis_url": redis_url, "stream": "t:records", "block_ms": 0},
        "rollout": {"canary_steps": [0.1, 0.5, 1.0], "min_requests": 8, "max_requests": 60, **rollout}})


def _gate(stable="v1", lower=0.01):
    """Offline gate evidence as the trainer writes it (train/gate/compare.py), with a chosen interval."""
    return {"stable": stable, "lower": lower, "upper": lower + 0.04, "diff": lower + 0.02, "records": 40,
            "positions": 900, "passed": lower > 0, "min_gain": 0.0, "reason": "set by the test",
            "per_record": [[0.1, 20]] * 40}


def _publish(reg, draft_dir, version, gate=None, **gate_kw):
    """Publish with gate evidence (default: passing against v1); gate=False: with none."""
    metrics = {} if gate is False else {"gate": gate or _gate(**gate_kw)}
    return reg.publish(draft_dir, version, metrics=metrics)


def _stable_and_candidate(tmp_path, redis_url, draft_dir, candidate, **rollout):
    """v1 published and stable, `candidate` published after it with passing gate evidence,
    and a fresh controller."""
    cfg = _cfg(tmp_path, redis_url, **rollout)
    reg = Registry.from_config(cfg)
    reg.publish(draft_dir, "v1")
    reg.promote("v1")
    _publish(reg, draft_dir, candidate)
    return cfg, reg, CanaryController(cfg)


def _record(version, acc_p, rng, n=24):
    """A request whose drafts are each accepted with probability acc_p, k=4 per step."""
    accepted, drafts = [], []
    while len(accepted) < n:
        for _ in range(4):
            if rng.random() < acc_p:
                accepted.append(True)
                drafts.append(7)
            else:
                accepted.append(False)
                drafts.append(9)
                break
        else:
            accepted.append(False)
            drafts.append(-1)  # bonus token after a fully accepted step
    accepted, drafts = accepted[:n], drafts[:n]
    return Record(request_id=f"r{rng.random()}", draft_version=version,
                  prompt_ids=np.arange(3, dtype=np.int32), output_ids=np.full(n, 5, np.int32),
                  topk_ids=np.zeros((n, 2), np.int32), topk_logprobs=np.zeros((n, 2), np.float16),
                  accepted=np.array(accepted), draft_tokens=np.array(drafts, np.int32),
                  draft_probs=np.full(n, 0.5, np.float32))


def _serve(prod, reg, stable_p, canary_p, rng, n):
    """n requests routed as the replicas would: the canary's share by weight."""
    a = reg.aliases()
    for _ in range(n):
        c = a["canary"]
        if c and rng.random() < c["weight"]:
            prod.submit(_record(c["version"], canary_p, rng))
        else:
            prod.submit(_record(a["stable"]["version"], stable_p, rng))
    prod.flush(30)


def _drive(ctrl, prod, reg, stable_p, canary_p, seed, max_requests=2000, batch=20):
    rng = random.Random(seed)
    served = 0
    while served < max_requests:
        _serve(prod, reg, stable_p, canary_p, rng, batch)
        served += batch
        done = [d for d in ctrl.tick() if d["action"] in ("promote", "rollback", "expired")]
        if done:
            return done[0], served
    raise AssertionError(f"no decision after {served} requests")


@redis
def test_better_candidate_is_promoted_step_by_step(tmp_path, redis_url, draft_dir):
    cfg = _cfg(tmp_path, redis_url)
    reg = Registry.from_config(cfg)
    reg.publish(draft_dir, "v1")
    reg.promote("v1")
    ctrl = CanaryController(cfg)
    assert ctrl.tick() == []  # nothing to roll out
    _publish(reg, draft_dir, "v2")
    with RecordProducer(redis_url, cfg.stream) as prod:
        start = ctrl.tick()
        assert [d["action"] for d in start] == ["start"] and reg.alias("canary")["weight"] == 0.1
        final, served = _drive(ctrl, prod, reg, 0.3, 0.7, seed=1)
    assert final["action"] == "promote" and final["version"] == "v2"
    actions = [d["action"] for d in ctrl.decisions]
    assert actions == ["start", "advance", "promote"]  # 10% -> 50% -> promoted
    assert reg.alias("stable")["version"] == "v2" and reg.alias("canary") is None
    # promoted on evidence of improvement, not on the absence of harm
    assert final["evidence"]["acceptance"]["lower"] > ctrl.rule.min_gain
    assert ctrl.decisions[0]["evidence"]["gate"]["stable"] == "v1"  # the start names the gate it passed
    log = reg.audit_log()
    assert [e["action"] for e in log] == actions and all(e["reason"] for e in log)
    assert served <= 1000


@redis
def test_bad_candidate_is_rolled_back_quickly_and_not_retried(tmp_path, redis_url, draft_dir):
    cfg, reg, ctrl = _stable_and_candidate(tmp_path, redis_url, draft_dir, "bad")
    with RecordProducer(redis_url, cfg.stream) as prod:
        ctrl.tick()
        final, served = _drive(ctrl, prod, reg, 0.5, 0.02, seed=2)
    assert final["action"] == "rollback" and final["version"] == "bad"
    # at 10% canary traffic: min_requests (8) canary requests need about 80; allow noise
    assert served <= 200
    assert reg.alias("canary") is None and reg.alias("stable")["version"] == "v1"
    assert final["evidence"]["acceptance"]["upper"] < -cfg.rollout.margin
    # a restarted controller reads the audit log and does not try "bad" again
    again = CanaryController(cfg, consumer_name="controller-2")
    assert again.tick() == [] and reg.alias("canary") is None


@redis
def test_candidates_without_passing_gate_evidence_are_gated_audited_and_never_served(tmp_path, redis_url, draft_dir):
    cfg = _cfg(tmp_path, redis_url)
    reg = Registry.from_config(cfg)
    reg.publish(draft_dir, "v1")
    reg.promote("v1")
    _publish(reg, draft_dir, "ok")  # the oldest: passing evidence against v1
    _publish(reg, draft_dir, "none", gate=False)  # published by hand: no evidence at all
    _publish(reg, draft_dir, "failing", lower=-0.003)  # its interval reaches below 0
    _publish(reg, draft_dir, "vs-parent", stable="t-v0002")  # passing, but against its parent, not stable
    ctrl = CanaryController(cfg)
    got = ctrl.tick()
    # newest first: each refused one is audited with its evidence; the first admitted one starts
    assert [(d["action"], d["version"]) for d in got] == [
        ("gated", "vs-parent"), ("gated", "failing"), ("gated", "none"), ("start", "ok")]
    assert reg.alias("canary")["version"] == "ok"
    log = {e["version"]: e for e in reg.audit_log() if e["action"] == "gated"}
    assert "against t-v0002, but stable is v1" in log["vs-parent"]["reason"]
    assert log["failing"]["evidence"]["gate"]["lower"] == -0.003 and "gate failed" in log["failing"]["reason"]
    assert "per_record" not in log["failing"]["evidence"]["gate"]  # the pairs stay in the manifest
    assert "no offline gate evidence" in log["none"]["reason"] and log["none"]["stable"] == "v1"
    # a restarted controller reads the audit: once "ok" is decided, nothing gated is ever canaried
    reg.rollback("by hand")
    again = CanaryController(cfg, consumer_name="controller-2")
    assert again.tick() == [] and reg.alias("canary") is None
    served = {e["version"] for e in reg.audit_log() if e["action"] == "start"}
    assert served == {"ok"}


@redis
def test_an_undecided_canary_expires_at_the_budget_and_stable_stays(tmp_path, redis_url, draft_dir):
    cfg, reg, ctrl = _stable_and_candidate(tmp_path, redis_url, draft_dir, "same", canary_steps=[0.5, 1.0],
                                           max_requests=30)
    with RecordProducer(redis_url, cfg.stream) as prod:
        assert [d["action"] for d in ctrl.tick()] == ["start"]
        final, served = _drive(ctrl, prod, reg, 0.4, 0.4, seed=5)
    assert final["action"] == "expired" and final["version"] == "same"
    assert final["evidence"]["canary"]["n"] >= 30 and final["evidence"]["acceptance"]["lower"] <= 0
    assert "point estimate is not evidence" in final["reason"]
    assert reg.alias("canary") is None and reg.alias("stable")["version"] == "v1"
    assert [e["action"] for e in reg.audit_log()] == ["start", "expired"]
    again = CanaryController(cfg, consumer_name="controller-2")  # an expired version is not tried again
    assert again.tick() == [] and reg.alias("canary") is None


@redis
def test_with_the_real_gate_a_worse_draft_never_becomes_canary_and_a_better_one_is_promoted(
        tmp_path, redis_url, tiny):
    """Gate evidence computed by train/ on the tiny target's own records, as the trainer does at
    export: stable is the 1-layer draft; a random-weights draft is refused, the 2-layer one
    (the target itself) admitted and then promoted on served evidence."""
    import torch

    from infra.drafts.layer import DraftSpec, build_draft, save_draft
    from infra.prompts import Prompt
    from train.gate.evaluator import gate_candidate
    from train.teacher.data import generate_teacher_records

    prompts = [Prompt(f"q{i}", f"rollout question {i}?" * (1 + i % 3), "other", "train") for i in range(10)]
    held_out = generate_teacher_records(tiny.model, tiny.tokenizer, prompts, max_new_tokens=6, top_k=259,
                                        progress=False)
    drafts = {"weak": build_draft(tiny.model, DraftSpec(num_layers=1)),
              "random": build_draft(tiny.model, DraftSpec(num_layers=1)),
              "full": build_draft(tiny.model, DraftSpec(num_layers=2))}
    with torch.no_grad():
        for i, p in enumerate(p for p in drafts["random"].parameters() if p.requires_grad):
            p.normal_(0, 0.5, generator=torch.Generator().manual_seed(i))
    for name, d in drafts.items():
        save_draft(d, DraftSpec(num_layers=d.config.num_hidden_layers), tmp_path / name,
                   target_ref={"spec": "tiny-random"})
    cfg = _cfg(tmp_path, redis_url, canary_steps=[0.5, 1.0])
    reg = Registry.from_config(cfg)
    reg.publish(tmp_path / "weak", "v1")
    reg.promote("v1")
    ctrl = CanaryController(cfg)

    def gate(name):
        return gate_candidate(drafts[name], drafts["weak"], "v1", held_out, 128, min_records=len(held_out),
                              resamples=300)

    _publish(reg, tmp_path / "random", "worse", gate=gate("random"))
    assert [(d["action"], d["version"]) for d in ctrl.tick()] == [("gated", "worse")]
    assert reg.alias("canary") is None
    _publish(reg, tmp_path / "full", "better", gate=gate("full"))
    assert [(d["action"], d["version"]) for d in ctrl.tick()] == [("start", "better")]
    with RecordProducer(redis_url, cfg.stream) as prod:
        final, _ = _drive(ctrl, prod, reg, 0.3, 0.6, seed=6)
    assert (final["action"], final["version"]) == ("promote", "better")
    started = [e["version"] for e in reg.audit_log() if e["action"] == "start"]
    assert "worse" not in started  # never served to a user


@redis
def test_controller_survives_a_dead_redis(tmp_path, draft_dir):
    from infra.redis.server import RedisServer

    with RedisServer(tmp_path / "redis") as srv:
        cfg = _cfg(tmp_path, srv.url, poll_s=0.05)
        reg = Registry.from_config(cfg)
        reg.publish(draft_dir, "v1")
        reg.promote("v1")
        ctrl = CanaryController(cfg)
        ctrl.start()
        srv.stop()
        import time

        time.sleep(1.0)
        assert ctrl._thread.is_alive() and ctrl.errors > 0  # logged and retried, not dead
        ctrl._stop.set()
        ctrl._thread.join(10)


@redis
def test_a_never_empty_stream_does_not_starve_decisions(tmp_path, redis_url, draft_dir, monkeypatch):
    """Records arriving as fast as they are read: each tick still reaches its decision."""
    from infra.records.streams import Delivery

    cfg, reg, ctrl = _stable_and_candidate(tmp_path, redis_url, draft_dir, "bad")
    ctrl.tick()  # "bad" becomes the canary at 10%
    rng = random.Random(3)

    reads = [0]

    def endless(count=None, block_ms=None):  # a stream that is never drained
        reads[0] += 1
        assert reads[0] < 20_000, "the controller kept draining and never decided"
        version = "bad" if rng.random() < 0.5 else "v1"
        return [Delivery(f"{rng.random()}-0", _record(version, 0.02 if version == "bad" else 0.5, rng))]

    monkeypatch.setattr(ctrl.consumer, "read", endless)
    monkeypatch.setattr(ctrl.consumer, "ack", lambda got: len(got))
    monkeypatch.setattr(ctrl, "_read", lambda budget_s=0.2: CanaryController._read(ctrl, budget_s))
    decisions = ctrl.tick()
    assert [d["action"] for d in decisions] == ["rollback"] and decisions[0]["version"] == "bad"


@redis
def test_a_manual_rollback_of_the_canary_is_not_undone_by_the_controller(tmp_path, redis_url, draft_dir):
    cfg, reg, ctrl = _stable_and_candidate(tmp_path, redis_url, draft_dir, "v2")
    assert [d["action"] for d in ctrl.tick()] == ["start"] and reg.alias("canary")["version"] == "v2"
    assert reg.rollback("osd registry rollback") == {"dropped_canary": "v2", "stable": "v1"}
    assert ctrl.tick() == [] and ctrl.tick() == []
    assert reg.alias("canary") is None and reg.alias("stable")["version"] == "v1"
    # a person may still make it the canary again: the controller then judges it as usual
    reg.set_canary("v2", 0.1)
    assert ctrl.tick() == [] and reg.alias("canary")["version"] == "v2"


@redis
def test_a_manual_rollback_of_stable_is_not_undone_by_the_controller(tmp_path, redis_url, draft_dir):
    cfg = _cfg(tmp_path, redis_url)
    reg = Registry.from_config(cfg)
    for v in ("v1", "v2"):
        _publish(reg, draft_dir, v)
    reg.promote("v1")
    reg.promote("v2")  # by hand: no audit entry of the controller's names v2
    ctrl = CanaryController(cfg)
    assert reg.rollback() == {"stable": "v1", "from": "v2"}
    assert ctrl.tick() == [] and reg.alias("canary") is None and reg.alias("stable")["version"] == "v1"


@redis
def test_a_tick_racing_a_manual_rollback_does_not_put_the_canary_back(tmp_path, redis_url, draft_dir, monkeypatch):
    """The person's rollback lands after the tick read the aliases and before it moves the canary."""
    import pipeline.rollout.controller as rollout
    from pipeline.rollout.canary_rule import Decision

    cfg, reg, ctrl = _stable_and_candidate(tmp_path, redis_url, draft_dir, "v2")
    ctrl.tick()  # v2 is the canary at 10%

    def rollback_then_advance(*a, **k):
        reg.rollback("by hand")
        return Decision("advance", "looked fine", {})

    monkeypatch.setattr(rollout, "decide", rollback_then_advance)
    assert ctrl.tick() == []
    assert reg.alias("canary") is None and reg.alias("stable")["version"] == "v1"
    assert [(e["action"], e["version"]) for e in reg.audit_log()] == [("start", "v2"), ("rollback", "v2")]


@pytest.mark.pure
def test_metrics_that_cannot_be_created_are_logged_and_the_controller_goes_on(monkeypatch, capsys):
    import ray
    from ray.util import metrics

    from pipeline.rollout.controller import _Metrics

    assert not _Metrics().ok  # outside Ray: nothing to export to, and nothing to say
    assert capsys.readouterr().out == ""

    def refuse(*a, **kw):
        raise ValueError("no metrics here")

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(metrics, "Gauge", refuse)
    m = _Metrics()
    assert not m.ok
    assert "rollout metrics off: cannot create them (ValueError: no metrics here)" in capsys.readouterr().out
    m.weight("v1", 0.5)  # the controller's calls are no-ops
    m.decision("v1", "promote")
