"""`osd serve` / `osd up` own their private redis-server: one that exits (a crash, the OOM
killer's SIGKILL) is started again on its port and data dir, so the replicas' producers, the
trainer and the controller reconnect with the URL they hold, and the AOF brings the stream back.
Before, it stayed dead until the operator restarted the whole stack (found by test_stack.py)."""

import os
import signal
import threading
import time

import pytest
import redis

from infra.config import load_config
from infra.redis.server import private_server
from pipeline.stack.launch import LocalStack

pytestmark = pytest.mark.redis


def test_a_private_redis_that_exits_is_started_again_on_its_port_with_its_data(tmp_path):
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    stack = LocalStack(cfg)
    stack.redis = first = private_server(cfg)
    watcher = threading.Thread(target=stack._watch_redis, daemon=True)
    watcher.start()
    try:
        redis.Redis.from_url(first.url).xadd("f:s", {"rec": b"1"})
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while stack.redis is first or not stack.redis.running:
            assert time.monotonic() < deadline, "the private redis-server was not started again"
            time.sleep(0.1)
        assert stack.redis.url == first.url and stack.redis_restarts == 1
        assert private_server(cfg) is stack.redis  # one server per data dir, not a second one
        assert redis.Redis.from_url(first.url).xlen("f:s") == 1
    finally:
        stack._stopping.set()
        watcher.join(10)
        stack.redis.stop()
    assert not watcher.is_alive()
