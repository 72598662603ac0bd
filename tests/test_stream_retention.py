"""stream.retention_s: records and dead letters older than the window are trimmed by time
(XTRIM MINID), the window's own kept; the id arithmetic pure, the trimming on a real Redis."""

import time

import pytest
import redis

from infra.config import ConfigError, load_config
from infra.records import streams
from infra.records.schema import encode
from infra.records.streams import FIELD, RecordProducer, dead_letter_stream, retention_min_id, trim_expired
from test_streams import cfg, make_record


def _parse(eid: str | bytes) -> tuple[int, int]:
    ms, seq = (eid.decode() if isinstance(eid, bytes) else eid).split("-")
    return int(ms), int(seq)


@pytest.mark.pure
def test_min_id_drops_ids_older_than_the_window_and_keeps_the_rest():
    now = 1_700_000_000.0
    floor = _parse(retention_min_id(now, 60.0))
    assert floor == (1_699_999_940_000, 0)
    assert (1_699_999_939_999, 7) < floor  # 60.001 s old: trimmed (XTRIM MINID drops ids below)
    assert (1_699_999_940_000, 0) >= floor  # exactly 60 s old: kept
    assert (1_699_999_999_000, 3) >= floor  # a second old: kept
    assert retention_min_id(now, 0.0) is None  # 0: no retention
    assert retention_min_id(10.0, 60.0) == "0-0"  # a window reaching before the epoch keeps all
    with pytest.raises(ValueError, match="retention_s must be >= 0"):
        retention_min_id(now, -1.0)


@pytest.mark.pure
def test_retention_is_in_the_config_off_by_default_and_never_negative():
    assert load_config(environ={}).stream.retention_s == 0
    assert load_config(environ={"OSD_STREAM__RETENTION_S": "3600"}).stream.retention_s == 3600
    with pytest.raises(ConfigError, match=r"stream\.retention_s"):
        load_config(environ={"OSD_STREAM__RETENTION_S": "-1"})


def _seed_old_and_new(client: redis.Redis, stream: str, now: float) -> tuple[list, list]:
    """Entries an hour old and a second old, in the stream and its dead letters."""
    old = [f"{int((now - 3600) * 1000)}-{i}" for i in range(3)]
    new = [f"{int((now - 1) * 1000)}-{i}" for i in range(2)]
    for key in (stream, dead_letter_stream(stream)):
        for i, eid in enumerate(old + new):
            client.xadd(key, {FIELD: encode(make_record(i))}, id=eid)
    return old, new


def _ids(client: redis.Redis, key: str) -> list[str]:
    return [eid.decode() for eid, _ in client.xrange(key)]


@pytest.mark.redis
def test_trim_expired_removes_old_entries_of_both_streams_and_keeps_new(redis_url):
    client = redis.Redis.from_url(redis_url)
    now = time.time()
    old, new = _seed_old_and_new(client, "t:records", now)
    assert trim_expired(client, "t:records", 0.0, now_s=now) == 0  # off: nothing touched
    assert trim_expired(client, "t:records", 600.0, now_s=now) == 2 * len(old)
    assert _ids(client, "t:records") == new and _ids(client, dead_letter_stream("t:records")) == new


@pytest.mark.redis
def test_producer_with_retention_trims_old_records_and_writes_new(redis_url):
    c = cfg(retention_s=600.0)
    client = redis.Redis.from_url(redis_url)
    old, kept = _seed_old_and_new(client, c.stream, time.time())
    with RecordProducer(redis_url, c) as p:
        assert p.submit(make_record(99)) and p.flush(10)
    left = _ids(client, c.stream)
    assert not set(old) & set(left) and left[:2] == kept and len(left) == 3  # the new record too
    assert _ids(client, dead_letter_stream(c.stream)) == kept


@pytest.mark.redis
def test_producer_without_retention_keeps_old_records(redis_url):
    c = cfg()
    client = redis.Redis.from_url(redis_url)
    old, kept = _seed_old_and_new(client, c.stream, time.time())
    with RecordProducer(redis_url, c) as p:
        assert p.submit(make_record(99)) and p.flush(10)
    assert _ids(client, c.stream)[:5] == old + kept


@pytest.mark.redis
def test_an_idle_producer_still_trims(redis_url, monkeypatch):
    import infra.records.streams

    monkeypatch.setattr(infra.records.streams, "TRIM_EVERY_S", 0.05)  # its idle wake-up, shortened
    c = cfg(retention_s=600.0)
    client = redis.Redis.from_url(redis_url)
    old, kept = _seed_old_and_new(client, c.stream, time.time())
    with RecordProducer(redis_url, c):  # nothing submitted
        deadline = time.monotonic() + 5
        while _ids(client, c.stream) != kept and time.monotonic() < deadline:
            time.sleep(0.02)
    assert _ids(client, c.stream) == kept


@pytest.mark.redis
def test_a_trim_that_removed_records_rewrites_the_aof_so_they_leave_the_disk(redis_url):
    c = cfg(retention_s=600.0)
    client = redis.Redis.from_url(redis_url)
    client.config_set("appendonly", "yes")
    try:
        _check_rewrites(client, c, redis_url)
    finally:
        client.config_set("appendonly", "no")


def _check_rewrites(client: redis.Redis, c, redis_url: str) -> None:
    _wait_no_rewrite(client)
    before = client.info("persistence").get("aof_rewrites", 0)
    _seed_old_and_new(client, c.stream, time.time())
    with RecordProducer(redis_url, c) as p:
        assert p.submit(make_record(99)) and p.flush(10)
    _wait_no_rewrite(client)
    assert client.info("persistence")["aof_rewrites"] > before
    after = client.info("persistence")["aof_rewrites"]
    never = cfg(retention_s=600.0, stream=c.stream + ":2")
    _seed_old_and_new(client, never.stream, time.time())
    with pytest.MonkeyPatch.context() as mp, RecordProducer(redis_url, never) as p:
        mp.setattr(streams, "AOF_REWRITE_S", 0.0)  # 0: never asks
        assert p.submit(make_record(98)) and p.flush(10)
    _wait_no_rewrite(client)
    assert client.info("persistence")["aof_rewrites"] == after


def _wait_no_rewrite(client: redis.Redis) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        info = client.info("persistence")
        if not info.get("aof_rewrite_in_progress") and not info.get("aof_rewrite_scheduled"):
            return
        time.sleep(0.05)
