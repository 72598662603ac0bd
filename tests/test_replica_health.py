"""TargetReplica.check_health (what Serve polls, and what /healthz reports) tells the truth:
a stalled request, a dead record producer or a dead alias poller fails it (issue 18)."""

import asyncio
import threading
import time

import pytest

from infra.config import load_config

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("one_thread")]


@pytest.fixture
def replica(redis_url, tmp_path):
    from serve.api.app import TargetReplica

    cfg = load_config(environ={}, overrides={
        "state_dir": str(tmp_path), "model": {"target": "tiny-random"},
        "serve": {"draft": "truncate:1", "max_new_tokens": 16, "stall_timeout_s": 0.2},
        "stream": {"redis_url": redis_url, "stream": "test:health"}})
    rep = TargetReplica(cfg.model_dump(mode="json"))
    yield rep
    rep.producer.close(timeout=2)


def _req(i):
    return {"kind": "completion", "prompt": [5, 6, 7], "max_tokens": 8, "request_id": f"h{i}",
            "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None}, "stop": [], "record": False}


def test_healthy_replica_passes(replica):
    assert replica.health()["status"] == "ok"
    assert asyncio.run(replica.generate(_req(0)))["finish_reason"] in ("stop", "length")
    replica.check_health()


def test_stalled_request_fails_health(replica):
    """A step that hangs on the event loop driving it; health is asked from another thread
    (in Serve, the controller's health call then times out on that loop, with the same end)."""
    gate = threading.Event()
    schedule = replica.engine.scheduler.schedule
    replica.engine.scheduler.schedule = lambda: (schedule(), gate.wait(10))[0]  # the step it plans hangs
    out = []
    driver = threading.Thread(target=lambda: out.append(asyncio.run(replica.generate(_req(1)))))
    driver.start()
    # Until the request is in the stalled step past the limit (0.2 s): on 2 loaded cores its
    # admission alone can take longer than a fixed sleep, and health is then rightly fine.
    deadline = time.monotonic() + 10
    while replica.engine.stalled_s() < 0.3 and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match="no progress"):
        replica.health()
    gate.set()
    driver.join(30)
    assert "output_ids" in out[0]
    replica.check_health()


def test_dead_producer_fails_health(replica):
    replica.producer.close(timeout=2)  # its thread ends, as a crash of it would
    with pytest.raises(RuntimeError, match="producer"):
        replica.check_health()
