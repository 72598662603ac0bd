"""The rollout controller SIGKILLed right after it moves an alias, then started again: a
rolled-back version is never canaried again, and the aliases always name loadable versions."""

import time

import pytest

from infra.registry import Registry
from pipeline.rollout.controller import CanaryController
from tests.faults.conftest import run_killed

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("one_thread")]

# The controller in its own process, its rule stubbed to take one decision.
_DECIDE = """
import json, sys
import pipeline.rollout.controller as ro
from pipeline.rollout.canary_rule import Decision
args = json.loads(sys.argv[1])
ro.decide = lambda *a, **k: Decision(args["action"], "forced by the fault test", {})
c = ro.CanaryController(args["cfg"])
for _ in range(3):
    c.tick()
"""


def _cfg(tmp_path, redis_url):
    from infra.config import load_config

    return load_config(environ={}, overrides={
        "state_dir": str(tmp_path), "stream": {"redis_url": redis_url, "stream": "t:records", "block_ms": 0}})


def _gated_ok(stable="v1"):
    return {"gate": {"stable": stable, "lower": 0.01, "upper": 0.05, "diff": 0.03, "records": 40,
                     "positions": 900, "passed": True, "min_gain": 0.0, "reason": "set by the test"}}


def _stable_and_candidate(tmp_path, redis_url, draft_dir):
    cfg = _cfg(tmp_path, redis_url)
    reg = Registry.from_config(cfg)
    reg.publish(draft_dir, "v1")
    reg.promote("v1")
    reg.publish(draft_dir, "v2", metrics=_gated_ok())
    return cfg, reg


def _after_restart(cfg, reg):
    restarted = CanaryController(cfg)
    for _ in range(3):
        restarted.tick()
    for a in reg.aliases().values():  # aliases always name loadable versions
        assert a is None or reg.exists(a["version"])
    return restarted


def _restarts(cfg):
    import redis

    from serve.api.ops import page as ops_page
    from serve.api.ops.source import OpsSource

    summary = OpsSource(cfg, client=redis.Redis.from_url(cfg.stream.redis_url)).summary([])
    html = ops_page.page(summary, live=False)
    assert "id=ops-restarts>Restarts: " in html
    rec = summary["loop"]["last_recovery"]  # the page says which part came back last, and when
    assert rec["component"] == "controller" and time.time() - 120 < rec["time"] <= time.time()
    assert "last back: controller at " in html
    return summary["loop"]["restarts"]


def test_kill_after_starting_a_canary(tmp_path, redis_url, draft_dir):
    cfg, reg = _stable_and_candidate(tmp_path, redis_url, draft_dir)
    run_killed(_DECIDE, "rollout.after_alias_move", {"action": "continue", "cfg": cfg.model_dump(mode="json")})
    assert reg.alias("canary")["version"] == "v2"
    _after_restart(cfg, reg)
    assert reg.alias("canary")["version"] == "v2"  # carried on at its weight, not started twice
    assert reg.alias("canary")["weight"] == cfg.rollout.canary_steps[0]


@pytest.mark.parametrize("action,stable,canary", [
    ("advance", "v1", "v2"), ("promote", "v2", None), ("rollback", "v1", None), ("expire", "v1", None)])
def test_kill_after_each_decision_s_alias_move(tmp_path, redis_url, draft_dir, action, stable, canary):
    cfg, reg = _stable_and_candidate(tmp_path, redis_url, draft_dir)
    assert [d["action"] for d in CanaryController(cfg).tick()] == ["start"]

    run_killed(_DECIDE, "rollout.after_alias_move", {"action": action, "cfg": cfg.model_dump(mode="json")})
    restarted = _after_restart(cfg, reg)
    assert _restarts(cfg)["controller"] >= 2  # the ops page shows it came back (start, killed one, this)
    got = reg.aliases()
    assert got["stable"]["version"] == stable
    assert (got["canary"] or {}).get("version") == canary, f"after {action}: v2 canaried again"
    if action in ("rollback", "expire"):
        assert "v2" in restarted.decided


def test_a_first_start_is_not_a_recovery_and_the_latest_restart_is(redis_url):
    import redis

    from infra.redis.loop_status import count_start, last_recovery, read_starts

    client, stream = redis.Redis.from_url(redis_url), "t:recovery"
    count_start(client, stream, "controller"), count_start(client, stream, "trainer-0")
    assert last_recovery(read_starts(client, stream), client, stream) is None
    count_start(client, stream, "trainer-0")
    time.sleep(0.01)
    count_start(client, stream, "controller")
    assert last_recovery(read_starts(client, stream), client, stream)["component"] == "controller"
