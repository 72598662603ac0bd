"""The canary controller against a real Redis stream and a file:// registry (synthetic records)."""

import random

import numpy as np
import pytest

from infra.records import Record
from infra.registry import Registry
from pipeline.rollout import CanaryController
from infra.streams import RecordProducer

pytestmark = [pytest.mark.usefixtures("one_thread")]
redis = pytest.mark.redis  # every test but the metrics one reads a real stream


@pytest.fixture(scope="module")
def draft_dir(tiny, tmp_path_factory):
    from infra.draft_model import DraftSpec, build_draft, save_draft

    spec = DraftSpec(num_layers=1)
    out = tmp_path_factory.mktemp("drafts") / "d"
    save_draft(build_draft(tiny.model, spec), spec, out, target_ref={"spec": "tiny-random"})
    return out


def _cfg(tmp_path, redis_url, **rollout):
    from infra.config import load_config

    return load_config(environ={}, overrides={
        "state_dir": str(tmp_path), "stream": {"redis_url": redis_url, "stream": "t:records", "block_ms": 0},
        "rollout": {"canary_steps": [0.1, 0.5, 1.0], "min_requests": 8, "max_requests": 60, **rollout}})


def _stable_and_candidate(tmp_path, redis_url, draft_dir, candidate):
    """v1 published and stable, `candidate` published after it, and a fresh controller."""
    cfg = _cfg(tmp_path, redis_url)
    reg = Registry.from_config(cfg)
    reg.publish(draft_dir, "v1")
    reg.promote("v1")
    reg.publish(draft_dir, candidate)
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
        done = [d for d in ctrl.tick() if d["action"] in ("promote", "rollback")]
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
    reg.publish(draft_dir, "v2")
    with RecordProducer(redis_url, cfg.stream) as prod:
        start = ctrl.tick()
        assert [d["action"] for d in start] == ["start"] and reg.alias("canary")["weight"] == 0.1
        final, served = _drive(ctrl, prod, reg, 0.3, 0.7, seed=1)
    assert final["action"] == "promote" and final["version"] == "v2"
    actions = [d["action"] for d in ctrl.decisions]
    assert actions == ["start", "advance", "promote"]  # 10% -> 50% -> promoted
    assert reg.alias("stable")["version"] == "v2" and reg.alias("canary") is None
    assert final["evidence"]["acceptance"]["lower"] > -cfg.rollout.margin
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
def test_controller_survives_a_dead_redis(tmp_path, draft_dir):
    from infra.redis_server import RedisServer

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
    from infra.streams import Delivery

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
        reg.publish(draft_dir, v)
    reg.promote("v1")
    reg.promote("v2")  # by hand: no audit entry of the controller's names v2
    ctrl = CanaryController(cfg)
    assert reg.rollback() == {"stable": "v1", "from": "v2"}
    assert ctrl.tick() == [] and reg.alias("canary") is None and reg.alias("stable")["version"] == "v1"


@redis
def test_a_tick_racing_a_manual_rollback_does_not_put_the_canary_back(tmp_path, redis_url, draft_dir, monkeypatch):
    """The person's rollback lands after the tick read the aliases and before it moves the canary."""
    import pipeline.rollout as rollout
    from pipeline.canary_rule import Decision

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

    from pipeline.rollout import _Metrics

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
