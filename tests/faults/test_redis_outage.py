"""Redis stopped (SIGSTOP), killed (SIGKILL) and restarted, or its connections cut, under a
producer's steady load: a submit never waits, every record is in the stream or counted as
dropped with its reason, and writing resumes by itself once Redis is back."""

import os
import signal
import threading
import time

import numpy as np
import pytest
import redis

from infra.config import StreamConfig
from infra.records.schema import Record
from infra.redis.server import RedisServer
from infra.records.streams import RecordProducer

pytestmark = pytest.mark.redis


def _record(i: int) -> Record:
    n = 8
    return Record(request_id=f"req-{i}", draft_version="v1", prompt_ids=np.arange(4, dtype=np.int32),
                  output_ids=np.full(n, 5, np.int32), topk_ids=np.zeros((n, 2), np.int32),
                  topk_logprobs=np.zeros((n, 2), np.float16), accepted=np.zeros(n, bool),
                  draft_tokens=np.full(n, -1, np.int32), draft_probs=np.zeros(n, np.float32))


class _Load:
    """Submits a record every 5 ms on its own thread, timing each submit."""

    def __init__(self, producer: RecordProducer):
        self.p, self.n, self.slowest = producer, 0, 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            self.p.submit(_record(self.n))
            self.slowest = max(self.slowest, time.perf_counter() - t0)
            self.n += 1
            time.sleep(0.005)

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def _cfg() -> StreamConfig:
    return StreamConfig(stream="f:records", socket_timeout_s=0.5, connect_timeout_s=0.3,
                        reconnect_backoff_s=0.1, reconnect_backoff_max_s=0.5, lag_budget=0, block_ms=100)


def _written_after(p: RecordProducer, before: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.stats().written > before:
            return True
        time.sleep(0.05)
    return False


def _accounting(p: RecordProducer, url: str, stream: str) -> None:
    assert p.flush(10)
    s = p.stats()
    assert s.submitted == s.written + s.dropped_total, s  # nothing lost uncounted
    assert set(s.dropped) <= {"redis_down", "queue_full"}, s.dropped
    in_stream = redis.Redis.from_url(url).xlen(stream)
    # A batch cut off mid-pipeline may have landed in part: counted dropped, present anyway.
    assert s.written <= in_stream <= s.written + s.dropped.get("redis_down", 0)


@pytest.mark.parametrize("how", ["sigstop", "sigkill", "dropped_connection"])
def test_an_outage_under_load_is_counted_and_recovered_from(tmp_path, how):
    server = RedisServer(tmp_path / "redis").start()
    c = _cfg()
    p = RecordProducer(server.url, c)
    load = _Load(p)
    try:
        time.sleep(0.5)
        assert _written_after(p, 0)
        if how == "sigstop":
            os.kill(server.pid, signal.SIGSTOP)
            time.sleep(1.5)
            os.kill(server.pid, signal.SIGCONT)
        elif how == "dropped_connection":  # a proxy or failover cutting the producer's connection
            for _ in range(20):
                redis.Redis.from_url(server.url).client_kill_filter(_type="normal", skipme=True)
                time.sleep(0.05)
        else:
            server.kill()
            time.sleep(1.5)
            server = RedisServer(tmp_path / "redis", port=server.port).start()  # the AOF brings the stream back
        before = p.stats()
        assert _written_after(p, before.written), "the producer never wrote again after Redis came back"
        time.sleep(0.3)
    finally:
        load.stop()
    try:
        assert load.slowest < 0.1, f"a submit waited {load.slowest:.3f} s on Redis"
        _accounting(p, server.url, c.stream)
        if how != "dropped_connection":  # a cut connection may cost nothing: the next batch reconnects
            assert p.stats().dropped.get("redis_down", 0) > 0
    finally:
        p.close()
        server.stop()
