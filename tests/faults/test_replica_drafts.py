"""A replica's drafts under faults: a torn alias file at start, a version whose first load
fails for a passing reason, and a client trying to choose its canary arm."""

import asyncio
import time

import pytest

from infra.registry import DigestMismatch
from loop_helpers import registry_for_replica
from serve.api.hot_swap import DraftRouter, Routing

pytestmark = [pytest.mark.usefixtures("one_thread")]


@pytest.fixture
def setup(tiny, tmp_path):
    return registry_for_replica(tiny, tmp_path, (1, 1), alias_poll_s=0.05, max_new_tokens=16)


def _wait(cond, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_torn_stable_alias_serves_without_a_draft_and_says_why(setup, capsys):
    from serve.api.app import TargetReplica

    cfg, reg = setup
    open(reg.root + "/aliases/stable.json", "w").close()  # torn: a crash left it empty
    rep = TargetReplica(cfg.model_dump(mode="json"))
    try:
        assert rep.router.state()["stable"] == "none"
        assert "stable.json" in capsys.readouterr().out  # the log names the file it could not read
        out = asyncio.run(rep.generate({"kind": "completion", "prompt": [5, 6, 7], "max_tokens": 8, "request_id": "r1",
                                        "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None},
                                        "stop": [], "record": False}))
        assert out["output_ids"] and out["draft_version"] == "none"  # requests still succeed, unspeculated
        reg.promote("v1")  # repaired: the poller picks it up
        _wait(lambda: rep.router.state()["stable"] == "v1", "the replica never followed the repaired alias")
    finally:
        rep.router.stop_following()


def test_a_torn_alias_can_be_overwritten_by_promote(setup):
    cfg, reg = setup
    open(reg.root + "/aliases/stable.json", "w").close()
    reg.promote("v2", reason="repair")
    assert reg.alias("stable")["version"] == "v2"


def test_a_transient_load_failure_is_retried_after_a_back_off():
    clock = [0.0]
    fails = {"v2": 1}

    def load(v):
        if fails.get(v):
            fails[v] -= 1
            raise OSError("registry mount went away for a moment")
        return f"runner-{v}"

    router = DraftRouter(load, Routing("v1", "runner-v1"), lambda m: None, clock=lambda: clock[0],
                         retry_base_s=5.0, max_failures=3)
    assert router.apply("v2") is False and "v2" in router.state()["refused"]
    assert router.apply("v2") is False  # inside the back-off: not tried again yet
    clock[0] = 6.0
    assert router.apply("v2") is True and router.routing.stable == "v2"
    assert "v2" not in router.state()["refused"]


def test_a_version_is_refused_for_good_after_max_failures_or_a_digest_mismatch():
    clock = [0.0]
    tries = {"v2": 0, "v3": 0}

    def load(v):
        tries[v] += 1
        raise (DigestMismatch("sha256 differs") if v == "v3" else OSError("still broken"))

    router = DraftRouter(load, Routing("v1", "runner-v1"), lambda m: None, clock=lambda: clock[0],
                         retry_base_s=1.0, max_failures=3)
    for _ in range(10):
        router.apply("v2")
        router.apply("v3")
        clock[0] += 100.0
    assert tries == {"v2": 3, "v3": 1}
    assert router.routing.stable == "v1"


def test_the_client_cannot_choose_its_canary_arm(setup):
    from serve.api.app import TargetReplica
    from serve.api.hot_swap import canary_share

    cfg, reg = setup
    reg.set_canary("v2", 0.5)
    rep = TargetReplica(cfg.model_dump(mode="json"))
    try:
        _wait(lambda: rep.router.state()["canary"] == "v2", "the canary never loaded")
        stable_id = next(f"id-{i}" for i in range(100) if canary_share(f"id-{i}") >= 0.5)
        arms = {rep._pick({"request_id": f"req-{i}", "route_key": stable_id})[0] for i in range(100)}
        assert arms == {"v1", "v2"}, "every request with the client's X-Request-Id went to one arm"
    finally:
        rep.router.stop_following()
