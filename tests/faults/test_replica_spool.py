"""A replica SIGKILLed with records queued for Redis: with the spool (infra/records/spool.py) every
record whose id a request got reaches the stream exactly once, replayed by the next producer
on the spool dir (a restarted replica, or a live one), even when Redis held the batch in flight
(SIGSTOP) and executed it after the kill."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import redis

from infra.config import StreamConfig
from infra.records.schema import decode
from infra.redis.server import RedisServer
from infra.records.spool import Spool, SpoolError, frame, marker_key, orphans, read_frames
from infra.records.streams import FIELD, RecordProducer, connect
from tests.faults.conftest import ROOT
from tests.test_streams import make_record as _record

STREAM = "f:spool"

# A replica: submits n records (each accepted submit is a request answered with its record id),
# prints the ids, then dies of SIGKILL without a close. socket_timeout_s is long so that a hung
# Redis keeps the writer blocked in its first batch while the rest wait in the queue.
_REPLICA = """
import json, os, signal, sys, time
import numpy as np
from infra.config import StreamConfig
from infra.records.schema import Record
from infra.records.streams import RecordProducer
a = json.loads(sys.argv[1])
p = RecordProducer(a["url"], StreamConfig(stream=a["stream"], lag_budget=0, socket_timeout_s=60),
                   spool_dir=a["spool"])
k = 8
ids = []
def submit(i):
    r = Record(request_id=f"r{i}", draft_version="v1", prompt_ids=np.arange(4, dtype=np.int32),
               output_ids=np.full(k, 5, np.int32), topk_ids=np.zeros((k, 2), np.int32),
               topk_logprobs=np.zeros((k, 2), np.float16), accepted=np.zeros(k, bool),
               draft_tokens=np.full(k, -1, np.int32), draft_probs=np.zeros(k, np.float32))
    if p.submit(r):
        ids.append(r.record_id)
submit(-1)  # connected and written once: the test may now hang Redis
assert p.flush(30)
print("ready", flush=True)
sys.stdin.readline()
for i in range(a["n"]):
    submit(i)
    time.sleep(a["pause"])
print(json.dumps(ids), flush=True)
time.sleep(a["linger"])
os.kill(os.getpid(), signal.SIGKILL)
"""


def _replica(url: str, spool, n: int, pause: float = 0.01, linger: float = 0.0) -> subprocess.Popen:
    args = {"url": url, "stream": STREAM, "spool": str(spool), "n": n, "pause": pause, "linger": linger}
    p = subprocess.Popen([sys.executable, "-c", _REPLICA, json.dumps(args)], cwd=ROOT, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert p.stdout.readline().strip() == "ready"
    return p


def _killed(p: subprocess.Popen) -> list[str]:
    out, _ = p.communicate("go\n", timeout=120)
    assert p.returncode == -signal.SIGKILL, p.returncode
    return json.loads(out)


def _ids_in_stream(url: str) -> list[str]:
    entries = redis.Redis.from_url(url).xrange(STREAM)
    return [decode(fields[FIELD]).record_id for _, fields in entries]


def _adopt(url: str, spool) -> RecordProducer:
    """A producer started on the spool dir (a restarted replica): it replays what it finds."""
    p = RecordProducer(url, StreamConfig(stream=STREAM, lag_budget=0), spool_dir=spool)
    deadline = time.monotonic() + 30
    while list(spool.glob("*.spool")) != [f for f in spool.glob("*.spool") if f.name.startswith(p._spool.id)]:
        assert time.monotonic() < deadline, "the dead producer's spool was never replayed"
        time.sleep(0.1)
    return p


@pytest.mark.redis
def test_a_replica_killed_while_redis_hangs_loses_no_record_and_duplicates_none(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    spool = tmp_path / "spool"
    try:
        replica = _replica(server.url, spool, 20)
        os.kill(server.pid, signal.SIGSTOP)
        try:  # the next batch is sent to a hung Redis; the others wait in the queue
            ids = _killed(replica)
        finally:
            os.kill(server.pid, signal.SIGCONT)  # Redis then runs the batch the dead process sent
        assert len(ids) == 21 and list(spool.glob("*.spool"))
        p = _adopt(server.url, spool)
        try:
            got = _ids_in_stream(server.url)
            assert sorted(got) == sorted(ids), f"{len(set(ids) - set(got))} lost, {len(got) - len(set(got))} twice"
            # The batch Redis ran after the kill was not replayed (its marker came with it); the
            # queue behind it was. The first record was written before Redis hung.
            assert 0 < p.stats().replayed < len(ids) - 1
        finally:
            p.close()
        assert not list(spool.glob("*.spool"))  # a clean close leaves nothing behind
    finally:
        server.stop()


@pytest.mark.redis
def test_a_replica_killed_under_load_loses_no_record(redis_url, tmp_path):
    spool = tmp_path / "spool"
    ids = _killed(_replica(redis_url, spool, 200, pause=0.002))
    _adopt(redis_url, spool).close()
    got = _ids_in_stream(redis_url)
    assert sorted(got) == sorted(ids)


@pytest.mark.redis
def test_a_live_producer_adopts_a_dead_ones_spool_and_keeps_its_own(redis_url, tmp_path):
    spool = tmp_path / "spool"
    live = RecordProducer(redis_url, StreamConfig(stream=STREAM, lag_budget=0), spool_dir=spool)
    try:
        assert live.submit(_record(0)) and live.flush(10)
        ids = _killed(_replica(redis_url, spool, 30, pause=0.0))
        deadline = time.monotonic() + 30
        while not set(ids) <= set(_ids_in_stream(redis_url)):  # within spool.SCAN_S, no restart needed
            assert time.monotonic() < deadline, "the live producer never replayed the dead one's spool"
            time.sleep(0.2)
        assert len(_ids_in_stream(redis_url)) == len(ids) + 1
    finally:
        live.close()


@pytest.mark.redis
def test_a_replay_cut_off_half_way_is_taken_up_where_it_stopped(redis_url, tmp_path):
    spool = tmp_path / "spool"
    dead = Spool(spool)
    from infra.records.schema import encode

    recs = [_record(i) for i in range(6)]
    payloads = [encode(r) for r in recs]
    for p in payloads:
        dead.append(p)
    # Frames 1-4 reached the stream before the adopter died: their marker says so.
    client = redis.Redis.from_url(redis_url)
    for p in payloads[:4]:
        client.xadd(STREAM, {FIELD: p})
    client.set(marker_key(STREAM, dead.id), 4)
    for seg in dead._segments:  # the producer dies: its lock goes with it
        os.close(seg.fd)
    _adopt(redis_url, spool).close()
    assert sorted(_ids_in_stream(redis_url)) == sorted(r.record_id for r in recs)


def test_frames_end_at_a_torn_or_corrupt_one():
    a, b = frame(1, b"one"), frame(2, b"two")
    assert read_frames(a + b) == [(1, b"one"), (2, b"two")]
    assert read_frames(a + b[:-1]) == [(1, b"one")]  # killed mid-write
    assert read_frames(a + b[:-1] + b"X") == [(1, b"one")]  # CRC mismatch
    assert read_frames(b"") == []


def test_a_spool_is_emptied_when_done_and_rolls_over_past_its_size(tmp_path):
    s = Spool(tmp_path, segment_bytes=100)
    seg, n = s.append(b"x" * 80)
    assert n == 1 and seg.path.stat().st_size > 80
    s.done([seg])
    assert seg.path.stat().st_size == 0  # drained: emptied, kept for the next records
    first, _ = s.append(b"x" * 120)
    second, _ = s.append(b"y")  # the first file is past its size and not done: a new one
    assert second is not first and len(list(tmp_path.glob("*.spool"))) == 2
    s.done([first])
    assert not first.path.exists() and second.path.exists()
    assert s.close() == 1 and second.path.exists()  # a record not done stays for the next producer


def test_a_live_spool_is_never_adopted(tmp_path):
    live = Spool(tmp_path)
    live.append(b"x")
    assert list(orphans(tmp_path)) == []  # its producer holds the lock
    live.close()


@pytest.mark.parametrize("kwargs,match", [({"segment_bytes": 0}, "segment_bytes"), ({"fsync_s": -1}, "fsync_s")])
def test_bad_spool_settings_are_refused(tmp_path, kwargs, match):
    with pytest.raises(SpoolError, match=match):
        Spool(tmp_path, **kwargs)


def test_a_spool_dir_that_cannot_be_made_is_said_at_start(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(SpoolError, match="cannot create the record spool dir"):
        RecordProducer("redis://127.0.0.1:1", StreamConfig(stream=STREAM), spool_dir=tmp_path / "file" / "spool")


@pytest.mark.redis
def test_the_producer_role_may_spool_and_replay_and_no_more(redis_url, tmp_path):
    from infra.redis.acl import acl_line

    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", *acl_line("producer", "osd-producer", "pw-p-123", STREAM).split()[1:])
    cfg = StreamConfig(stream=STREAM, lag_budget=0,
                       users={"producer": {"password": "pw-p-123"}})
    spool = tmp_path / "spool"
    try:
        ids = _killed(_replica(redis_url, spool, 10, pause=0.0))
        with RecordProducer(redis_url, cfg, spool_dir=spool) as p:  # MULTI/EXEC and the markers' GET, SET
            assert p.submit(_record(0)) and p.flush(10)
            deadline = time.monotonic() + 30
            while [f for f in spool.glob("*.spool") if not f.name.startswith(p._spool.id)]:
                assert time.monotonic() < deadline, "the dead producer's spool was never replayed"
                time.sleep(0.1)
            assert not p.stats().dropped, p.stats()
        assert set(ids) <= set(_ids_in_stream(redis_url)) and len(_ids_in_stream(redis_url)) == len(ids) + 1
        with pytest.raises(redis.exceptions.NoPermissionError):  # a marker, never a record
            connect(redis_url, cfg, role="producer").xrange(STREAM)
    finally:
        admin.execute_command("ACL", "DELUSER", "osd-producer")
