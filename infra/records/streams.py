"""Records over Redis Streams: a producer that never holds a request, a consumer that never loses one.

Producer (serving side). Serving must not slow down or fail because Redis is slow, down or
full: `submit()` only puts the record into a bounded in-memory queue; a background thread
encodes and XADDs in pipelined batches (MAXLEN ~ cap). A record is *dropped and counted*,
never waited for, when the queue is full, Redis is unreachable (short socket timeouts, then
a doubling back-off during which nothing is tried), Redis is full (maxmemory with
noeviction: it refuses writes rather than evict stream data), or the trainers' backlog is
over the lag budget (fresh data is worth more than a backlog the trimming would eat anyway).
The policy is counted drops, not a spool: a request's record is worth less than the
request's latency, so nothing waits for Redis, and every record is either in the stream or
counted in `stats().dropped` by reason (served as osd_records_dropped_total{reason}; the
chart's OSDRecordStreamDown alert fires within a minute of redis_down / redis_full drops).
The queue is written as soon as a record arrives, so a SIGKILL loses at most the batch in
flight; an exit without close() still writes what is queued (an atexit hook, EXIT_FLUSH_S).
With a spool dir (a replica's is <state_dir>/spool) a SIGKILL loses nothing: submit() appends
the record to an on-disk spool before it returns, and the next producer on that dir replays
what a dead one left, each record once (infra.records.spool).
With `stream.retention_s` set it also deletes what is older than that from the stream and its
dead-letter stream (XTRIM MINID), every TRIM_EVERY_S seconds whether or not records come.

Consumer (training side). A consumer-group reader with at-least-once delivery: entries stay
pending until the caller acks them, entries a dead consumer held longer than claim_idle_ms
are taken over with XAUTOCLAIM before new ones are read, an entry that does not decode is
moved to `<stream>:dead` (with the reason and its original id) and acked so it cannot jam
the group, and a record id seen recently is skipped (and acked) so producer retries do
not train twice.

Entries hold one field, b"rec", the payload of infra.records.schema.encode.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import socket
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ExecAbortError, OutOfMemoryError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from infra.config import StreamConfig, redis_username
from infra.records.schema import Record, RecordError, UnknownSchemaVersion, decode, encode
from infra.records.spool import MARKER_TTL_S, SCAN_S, Spool, marker_key, orphans

log = logging.getLogger(__name__)

FIELD = b"rec"
# Tuning whose defaults every deployment used; once settings (stream.*), now constants.
QUEUE_SIZE = 10_000  # records waiting for the writer thread; when it is full, submit() drops
WRITE_BATCH = 64  # XADDs per pipelined round trip
LAG_REFRESH_S = 1.0  # the trainers' lag (XINFO GROUPS) is read at most this often
# After a trim by retention_s removed records, Redis is asked to rewrite its AOF at most this
# often, so the trimmed records' bytes leave the disk too, not only memory.
AOF_REWRITE_S = 3600.0
READ_COUNT = 64  # entries per XREADGROUP
DEDUPE_WINDOW = 100_000  # record ids a consumer remembers to skip duplicates
# Errors that mean "Redis is not reachable right now", as opposed to a bad command.
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)


def dead_letter_stream(stream: str) -> str:
    return f"{stream}:dead"


def retention_min_id(now_s: float, retention_s: float) -> str | None:
    """The oldest stream id a retention of `retention_s` seconds keeps at `now_s` (epoch
    seconds), or None for no retention (0). Ids are `<ms>-<seq>` from the writer's clock, so
    every entry written before now - retention_s is below `<ms>-0`."""
    if not retention_s >= 0:
        raise ValueError(f"retention_s must be >= 0, got {retention_s}")
    if retention_s == 0:
        return None
    return f"{max(0, int((now_s - retention_s) * 1000))}-0"


def rewrite_aof(client: redis.Redis) -> bool:
    """Ask Redis to rewrite its append-only file in the background, so entries trimmed from
    memory leave the disk as well. False where a rewrite is already running or Redis keeps no
    AOF (nothing to do)."""
    try:
        client.bgrewriteaof()
    except redis.ResponseError as e:  # "Background append only file rewriting already in progress"
        log.info("record producer: no AOF rewrite now: %s", e)
        return False
    return True


def trim_expired(client: redis.Redis, stream: str, retention_s: float, *, now_s: float | None = None) -> int:
    """Delete the entries of `stream` and its dead-letter stream older than `retention_s`
    (exact XTRIM MINID: a retention is a promise, unlike the MAXLEN cap's ~). Returns how many."""
    min_id = retention_min_id(time.time() if now_s is None else now_s, retention_s)
    if min_id is None:
        return 0
    pipe = client.pipeline(transaction=False)
    for key in (stream, dead_letter_stream(stream)):
        pipe.xtrim(key, minid=min_id, approximate=False)
    return sum(pipe.execute())


def connect(url: str, cfg: StreamConfig, *, retries: int = 0, role: str | None = None) -> redis.Redis:
    """A client for redis:// or rediss:// URLs (user:password@ allowed). role: producer,
    trainer or admin: that role's ACL user (stream.users) in place of the URL's credentials,
    where one is configured.

    Binary replies (payloads are bytes); every call bounded by the config's timeouts; redis-py's
    default of 3 retries with up to 10 s back-off is replaced, because the producer must
    fail fast and do its own back-off."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"redis URL must start with redis://, rediss:// or unix://, got {url!r}")
    retry = Retry(ExponentialBackoff(cap=0.5, base=0.05) if retries else NoBackoff(), retries)
    user = getattr(cfg.users, role) if role else None
    creds: dict[str, str] = {}
    if user is not None and user.password:
        # The URL's own user:password@ would win over keyword arguments in redis-py: drop it.
        url = _without_userinfo(url)
        creds = {"username": redis_username(role), "password": user.password}
    return redis.Redis.from_url(
        url,
        **creds,
        socket_timeout=cfg.socket_timeout_s,
        socket_connect_timeout=cfg.connect_timeout_s,
        retry=retry,
        health_check_interval=0,
        decode_responses=False,
        protocol=2,  # the reply shapes parsed here (XREADGROUP, XAUTOCLAIM) are RESP2's
    )


def _without_userinfo(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def _s(x: Any) -> Any:
    return x.decode() if isinstance(x, bytes) else x


def _decoded(entries: list, field: bytes = FIELD) -> Iterator[tuple[bytes, Record]]:
    """(entry id, record) of the entries whose payload decodes; the others are the consumers'
    to dead-letter."""
    for eid, fields in entries:
        try:
            rec = decode(fields[field])
        except (KeyError, RecordError):
            continue
        yield eid, rec


def scan_records(client: redis.Redis, key: str, *, field: bytes = FIELD, start: str = "-",
                 batch: int = 500) -> Iterator[tuple[bytes, Record]]:
    """(entry id, record) of every decodable entry of `key` from id `start` on, oldest first,
    read in pages of `batch` without touching any consumer group. Undecodable entries are
    skipped here: the consumers dead-letter them. field: where the payload is (a dead letter
    keeps it under b"orig.rec")."""
    while True:
        entries = client.xrange(key, min=start, max="+", count=batch)
        yield from _decoded(entries, field)
        if len(entries) < batch:
            return
        ms, seq = _s(entries[-1][0]).split("-")
        start = f"{ms}-{int(seq) + 1}"


def read_records(client: redis.Redis, stream: str, *, since_s: float = 0.0, batch: int = 500) -> list[Record]:
    """Every decodable record still in the stream written at or after `since_s` (epoch seconds),
    oldest first (scan_records)."""
    return [rec for _, rec in scan_records(client, stream, start=f"{int(since_s * 1000)}-0", batch=batch)]


def recent_records(client: redis.Redis, stream: str, max_tokens: int, *, batch: int = 200) -> list[Record]:
    """The newest decodable records whose outputs hold about `max_tokens` tokens in all (the
    one that crosses it included), oldest first, read newest first without touching any
    consumer group: what a new replica's suffix index starts from."""
    out: list[Record] = []
    tokens = 0
    end = "+"
    while tokens < max_tokens:
        entries = client.xrevrange(stream, max=end, min="-", count=batch)
        for _, rec in _decoded(entries):
            out.append(rec)
            tokens += len(rec.output_ids)
            if tokens >= max_tokens:
                break
        if len(entries) < batch:
            break
        ms, seq = _s(entries[-1][0]).split("-")
        end = f"{ms}-{int(seq) - 1}" if int(seq) > 0 else f"{int(ms) - 1}-18446744073709551615"
    return out[::-1]


def group_info(client: redis.Redis, stream: str) -> dict[str, dict[str, Any]]:
    """XINFO GROUPS as {group name: {field: value}}, str names and ids; {} if the stream is missing."""
    try:
        groups = client.xinfo_groups(stream)
    except ResponseError as e:
        if "no such key" in str(e).lower():
            return {}
        raise
    return {_s(g["name"]): {k: _s(v) for k, v in g.items()} for g in groups}


# -- producer -------------------------------------------------------------------------------

QUEUE_FULL, REDIS_DOWN, REDIS_FULL, LAG, INVALID, ERROR, CLOSED = (
    "queue_full", "redis_down", "redis_full", "lag", "invalid", "error", "closed")
_STOP = object()
# How long an exiting process waits for its queued records to be written (then counts the
# rest as `closed`): bounded, so a Redis that is down cannot hold a shutdown.
EXIT_FLUSH_S = 5.0
# How often the producer trims to stream.retention_s: one XTRIM pair per this many seconds,
# writing or idle, so a record outlives the retention by at most this.
TRIM_EVERY_S = 5.0


@dataclass
class _Spooled:
    """A queued record that is in the spool: its payload, its file (None: the append failed,
    so it is queued unspooled) and frame number."""
    payload: bytes
    segment: Any
    number: int


@dataclass
class ProducerStats:
    submitted: int = 0
    written: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # by reason: queue_full, redis_down, lag, ...
    queued: int = 0
    lag: int | None = None  # trainers' backlog (unread + unacked entries) at the last refresh
    redis_up: bool = True
    replayed: int = 0  # records a dead producer left in the spool, written by this one
    spooled: int = 0  # left in the spool at close() for the next producer: neither written nor lost

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())


class RecordProducer:
    """Fire-and-forget writer of records to `cfg.stream`. Thread-safe `submit`."""

    def __init__(self, url: str, cfg: StreamConfig, *, client: redis.Redis | None = None,
                 queue_size: int = QUEUE_SIZE, spool_dir: str | os.PathLike | None = None):
        self.cfg = cfg
        # Opened first: a spool dir that cannot be made is a configuration error, said at start.
        self._spool = Spool(spool_dir) if spool_dir is not None else None
        self._spool_lock = threading.Lock()
        self._scan_at = float("-inf")
        self.stream = cfg.stream
        self._client = client if client is not None else connect(url, cfg, role="producer")
        self._q: queue.Queue = queue.Queue(queue_size)
        self._cond = threading.Condition()
        self._unfinished = 0  # submitted and queued, not yet written or dropped; flush waits for 0
        self._stats = ProducerStats()
        self._closed = False
        # Writer-thread state only.
        self._down_until = 0.0
        self._backoff = cfg.reconnect_backoff_s
        self._lag_at = float("-inf")
        self._full = False  # the last batch met an out-of-memory Redis
        self._trim_at = float("-inf")
        self._rewrite_at = float("-inf")
        self._thread = threading.Thread(target=self._run, name=f"osd-producer[{self.stream}]", daemon=True)
        self._thread.start()
        # An exit that never calls close() (a replica's process ending, a CLI returning) still
        # writes what is queued: the daemon writer would be frozen mid-queue otherwise. A weak
        # reference, so the hook keeps no producer alive.
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- request side: never touches Redis --

    def submit(self, record: Record | bytes) -> bool:
        """Queue one record (or an encoded payload). Returns at once; False if it was dropped."""
        if not isinstance(record, (Record, bytes, bytearray, memoryview)):
            raise TypeError(f"submit() takes a Record or bytes, got {type(record).__name__}")
        with self._cond:
            self._stats.submitted += 1
            if self._closed:
                self._stats.dropped[CLOSED] = self._stats.dropped.get(CLOSED, 0) + 1
                return False
            self._unfinished += 1
        if self._spool is not None:
            return self._submit_spooled(record)
        try:
            self._q.put_nowait(record)
        except queue.Full:
            self._finish(0, {QUEUE_FULL: 1})
            return False
        return True

    def _submit_spooled(self, record: Record | bytes) -> bool:
        # Encoded here, not in the writer, because the spool holds bytes; the writer then has
        # nothing to encode, so the work moves rather than grows.
        try:
            payload = encode(record) if isinstance(record, Record) else bytes(record)
        except RecordError as e:
            log.warning("record producer: dropping invalid record %s: %s", record.record_id, e)
            self._finish(0, {INVALID: 1})
            return False
        # One lock over append and enqueue: the queue must hold frames in frame order, since a
        # batch's marker says "every frame up to this one is in the stream".
        with self._spool_lock:
            try:
                item = _Spooled(payload, *self._spool.append(payload))
            except OSError as e:  # a full or failing disk: the record goes unspooled, as before
                log.warning("record producer: spool append failed (%s); this record is queued without it", e)
                item = _Spooled(payload, None, 0)
            try:
                self._q.put_nowait(item)
            except queue.Full:
                self._spool_done([item])
                self._finish(0, {QUEUE_FULL: 1})
                return False
        return True

    def _spool_done(self, items: list[Any]) -> None:
        segs = [it.segment for it in items if isinstance(it, _Spooled) and it.segment is not None]
        if segs:
            self._spool.done(segs)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued record is written or dropped; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._unfinished == 0, timeout)

    @property
    def alive(self) -> bool:
        """Whether the writer thread still runs (a health check fails when it has died)."""
        return self._thread.is_alive()

    def stats(self) -> ProducerStats:
        with self._cond:
            s = self._stats
            return ProducerStats(s.submitted, s.written, dict(s.dropped), self._q.qsize(), s.lag, s.redis_up,
                                 s.replayed, s.spooled)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (bounded by `timeout`), stop the thread, close the connection."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        try:
            self._q.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        left = []
        while True:  # the thread did not get to these (timeout): count them, don't lose them silently
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                left.append(item)
        # A spooled one stays in the spool file for the next producer to replay: not lost.
        kept = sum(isinstance(it, _Spooled) and it.segment is not None for it in left)
        if left:
            self._finish(0, {CLOSED: len(left) - kept}, spooled=kept)
        if self._spool is not None and not self._thread.is_alive():
            self._spool.close()  # deletes the files unless records are left in them
        self._client.close()

    def __enter__(self) -> "RecordProducer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- writer thread --

    def _finish(self, written: int, dropped: dict[str, int], spooled: int = 0) -> None:
        with self._cond:
            s = self._stats
            s.written += written
            s.spooled += spooled
            n = written + spooled
            for reason, k in dropped.items():
                if k:
                    s.dropped[reason] = s.dropped.get(reason, 0) + k
                    n += k
            self._unfinished -= n
            if self._unfinished <= 0:
                self._cond.notify_all()

    def _run(self) -> None:
        self._adopt(time.monotonic())
        wake = min(TRIM_EVERY_S if self.cfg.retention_s else float("inf"),
                   SCAN_S if self._spool is not None else float("inf"))
        while True:
            try:
                # Blocks idle at no CPU cost; close() wakes it with _STOP. With a retention it
                # also wakes to trim a stream nothing is written to, with a spool to adopt
                # what a dead producer left.
                item = self._q.get(timeout=None if wake == float("inf") else wake)
            except queue.Empty:
                self._trim(time.monotonic())
                self._adopt(time.monotonic())
                continue
            batch, stop = [], item is _STOP
            if not stop:
                batch.append(item)
            while not stop and len(batch) < WRITE_BATCH:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stop = True
                else:
                    batch.append(item)
            if batch:
                try:
                    self._write(batch)
                except Exception:  # never let the thread die: every later record would sit in the queue
                    log.exception("record producer: unexpected error, %d records dropped", len(batch))
                    self._finish(0, {ERROR: len(batch)})
                finally:
                    self._spool_done(batch)
            if stop:
                return

    def _write(self, batch: list[Any]) -> None:
        now = time.monotonic()
        # First, so the stream is trimmed even while the lag budget drops every batch, and a
        # flush() returns with it trimmed; a trim that finds Redis gone drops this batch.
        self._trim(now)
        self._adopt(now)
        if now < self._down_until:
            self._finish(0, {REDIS_DOWN: len(batch)})
            return
        payloads, invalid, last = [], 0, 0
        for item in batch:
            if isinstance(item, _Spooled):
                payloads.append(item.payload)
                last = max(last, item.number)
            elif isinstance(item, Record):
                try:
                    payloads.append(encode(item))
                except RecordError as e:
                    invalid += 1
                    log.warning("record producer: dropping invalid record %s: %s", item.record_id, e)
            else:
                payloads.append(bytes(item))
        try:
            if self._over_budget(now):
                self._finish(0, {LAG: len(payloads), INVALID: invalid})
                return
            if last:
                self._spool.sync(now)  # at most every spool.FSYNC_S; for a power loss, not a SIGKILL
            # Spooled: the batch and its marker in one transaction, so after a crash the marker
            # tells a replay exactly which frames are in the stream (infra.records.spool).
            pipe = self._client.pipeline(transaction=last > 0)
            for p in payloads:
                pipe.xadd(self.stream, {FIELD: p}, maxlen=self.cfg.max_entries, approximate=True)
            if last:
                pipe.set(marker_key(self.stream, self._spool.id), last, ex=MARKER_TTL_S)
            results = pipe.execute(raise_on_error=False)[:len(payloads)] if payloads else []
        except ExecAbortError as e:  # a transaction refused whole: OOM at queue time (noeviction)
            full = "OOM" in str(e) or "maxmemory" in str(e)
            if full and not self._full:
                log.warning("record producer: Redis is out of memory (maxmemory reached): dropping records as "
                            "redis_full until it has room")
            self._full = full
            self._mark_up()
            self._finish(0, {REDIS_FULL if full else ERROR: len(payloads), INVALID: invalid})
            return
        except _UNREACHABLE as e:
            # Some XADDs of the batch may have landed; they are counted as dropped (over-counting
            # drops is the safe side, and a consumer dedupes anyway if a caller resubmits).
            self._mark_down(e)
            self._finish(0, {REDIS_DOWN: len(payloads), INVALID: invalid})
            return
        except RedisError as e:
            log.warning("record producer: %s; %d records dropped", e, len(payloads))
            self._finish(0, {ERROR: len(payloads), INVALID: invalid})
            return
        errors = [r for r in results if isinstance(r, Exception)]
        full = sum(isinstance(r, OutOfMemoryError) for r in errors)
        if full and not self._full:  # once per episode, like redis_down: the counts say how many
            log.warning("record producer: Redis is out of memory (maxmemory reached; noeviction keeps the "
                        "stream intact): dropping records as redis_full until it has room. Its maxmemory is "
                        "below stream.memory_budget_mb, or something besides the capped stream fills it")
        self._full = full > 0
        if len(errors) > full:
            log.warning("record producer: %d of %d XADDs failed: %s", len(errors) - full, len(results),
                        next(r for r in errors if not isinstance(r, OutOfMemoryError)))
        self._mark_up()
        self._finish(len(results) - len(errors), {REDIS_FULL: full, ERROR: len(errors) - full, INVALID: invalid})

    def _adopt(self, now: float) -> None:
        """Replay the spools dead producers left in our spool dir, at most every SCAN_S, never
        while Redis is down. Frames at or below a spool's marker are in the stream already;
        the rest go in batches, each with the marker moved in its transaction, so a replay cut
        off half-way is taken up where it stopped, never written twice."""
        if self._spool is None or now < self._scan_at + SCAN_S or now < self._down_until:
            return
        self._scan_at = now
        try:
            self._replay_orphans()
        except Exception:  # never let the writer thread die over another producer's leftovers
            log.exception("record producer: replaying the spools in %s failed; retried in %.0f s",
                          self._spool.dir, SCAN_S)

    def _replay_orphans(self) -> None:
        for orphan in orphans(self._spool.dir, self._spool.id):
            try:
                if not self._replay(orphan):
                    return
            finally:
                orphan.release()  # a no-op once removed; otherwise kept for the next scan

    def _replay(self, orphan: Any) -> bool:
        """Write one dead producer's spool and delete it; False when Redis is unreachable."""
        key = marker_key(self.stream, orphan.spool_id)
        try:
            landed = int(self._client.get(key) or 0)
            todo = [(n, p) for n, p in orphan.frames if n > landed]
            for i in range(0, len(todo), WRITE_BATCH):
                chunk = todo[i: i + WRITE_BATCH]
                pipe = self._client.pipeline(transaction=True)
                for _, p in chunk:
                    pipe.xadd(self.stream, {FIELD: p}, maxlen=self.cfg.max_entries, approximate=True)
                pipe.set(key, chunk[-1][0], ex=MARKER_TTL_S)
                pipe.execute()
                with self._cond:
                    self._stats.replayed += len(chunk)
        except _UNREACHABLE as e:
            self._mark_down(e)
            return False
        except RedisError as e:
            log.warning("record producer: replaying the spool of %s failed: %s", orphan.spool_id, e)
            return True
        orphan.remove()
        if todo:
            log.warning("record producer: replayed %d records a dead producer (%s) left in its spool "
                        "(%d were in the stream already)", len(todo), orphan.spool_id, len(orphan.frames) - len(todo))
        return True

    def _trim(self, now: float) -> None:
        """Trim to stream.retention_s, at most every TRIM_EVERY_S, never while Redis is down."""
        if not self.cfg.retention_s or now < self._trim_at + TRIM_EVERY_S or now < self._down_until:
            return
        self._trim_at = now
        try:
            trimmed = trim_expired(self._client, self.stream, self.cfg.retention_s)
            if trimmed and AOF_REWRITE_S and now >= self._rewrite_at + AOF_REWRITE_S:
                self._rewrite_at = now
                rewrite_aof(self._client)
        except _UNREACHABLE as e:
            self._mark_down(e)
        except RedisError as e:  # e.g. a Redis before 6.2, which has no MINID
            log.warning("record producer: trimming to stream.retention_s failed: %s", e)

    def _over_budget(self, now: float) -> bool:
        budget = self.cfg.lag_budget
        if budget <= 0:
            return False
        if now - self._lag_at >= LAG_REFRESH_S:
            lag = self._read_backlog()
            self._lag_at = now
            with self._cond:
                self._stats.lag = lag
        lag = self._stats.lag
        return lag is not None and lag >= budget

    def _read_backlog(self) -> int:
        """Entries the trainers' group (`cfg.group`) still needs: not yet delivered (lag) plus
        delivered and not acked (pending). A trainer holds what it read until its checkpoint;
        if those did not count, the budget would let MAXLEN trim them, and a trainer that
        then died would leave nothing to redeliver. 0 before the group exists (MAXLEN bounds
        the stream). Other groups (the rollout controller's) only observe: their backlog
        never costs the trainers a record."""
        g = group_info(self._client, self.stream).get(self.cfg.group)
        if g is None:
            return 0
        lag = g.get("lag")
        if lag is None:
            # Redis cannot tell (e.g. entries deleted mid-stream); the stream length is an
            # upper bound of lag + pending, so the budget still holds.
            return int(self._client.xlen(self.stream))
        return int(lag) + int(g.get("pending", 0))

    def _mark_down(self, err: Exception) -> None:
        self._down_until = time.monotonic() + self._backoff
        with self._cond:
            was_up, self._stats.redis_up = self._stats.redis_up, False
        if was_up:
            log.warning("record producer: redis unreachable (%s); dropping records, retrying in %.1fs",
                        err, self._backoff)
        self._backoff = min(self._backoff * 2, self.cfg.reconnect_backoff_max_s)
        self._lag_at = float("-inf")  # re-read the lag after reconnecting

    def _mark_up(self) -> None:
        self._backoff = self.cfg.reconnect_backoff_s
        with self._cond:
            was_down, self._stats.redis_up = not self._stats.redis_up, True
        if was_down:
            log.warning("record producer: redis reachable again, writing records")


def _close_at_exit(ref: "weakref.ref[RecordProducer]") -> None:
    producer = ref()
    if producer is not None:
        producer.close(timeout=EXIT_FLUSH_S)


# -- consumer -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Delivery:
    """One record handed to the caller; pass it back to `ack` once it is done with."""

    entry_id: str
    record: Record
    claimed: bool = False  # taken over from a consumer that held it too long (maybe a redelivery)


@dataclass
class ConsumerStats:
    delivered: int = 0
    acked: int = 0
    claimed: int = 0  # entries taken over with XAUTOCLAIM
    duplicates: int = 0  # skipped (and acked) because their record id was seen
    trimmed: int = 0  # pending entries the MAXLEN cap deleted before anyone acked them
    dead_lettered: dict[str, int] = field(default_factory=dict)  # by reason: corrupt, unknown_version, ...

    @property
    def dead_total(self) -> int:
        return sum(self.dead_lettered.values())


class RecordConsumer:
    """Reads records of `cfg.stream` as one consumer of `cfg.group`. Not thread-safe: one per thread."""

    def __init__(self, url: str, cfg: StreamConfig, *, name: str | None = None,
                 client: redis.Redis | None = None, expect_target_sha256: str | None = None):
        # A BLOCK at least as long as the socket timeout turns every idle read into a timeout error.
        if cfg.block_ms >= cfg.socket_timeout_s * 1000:
            raise ValueError(f"block_ms ({cfg.block_ms}) must be shorter than socket_timeout_s "
                             f"({cfg.socket_timeout_s}s)")
        self.cfg = cfg
        self.stream, self.group = cfg.stream, cfg.group
        self.dead_stream = dead_letter_stream(cfg.stream)
        # The trainer's target identity: a record computed by other target weights (schema v2's
        # target_sha256) is dead-lettered as "wrong_target", never handed out. v1 records carry
        # no identity and pass.
        self.expect_target_sha256 = expect_target_sha256
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self._client = client if client is not None else connect(url, cfg, retries=2, role="trainer")
        self._stats = ConsumerStats()
        self._seen: OrderedDict[str, str] = OrderedDict()  # record id -> entry id it was delivered in
        # Entries handed to the caller and not acked yet. A caller that holds records until a
        # checkpoint (the trainer) calls keep_alive() so that nobody, itself included, takes
        # them over as abandoned while it still has them.
        self._held: set[str] = set()
        self._claim_cursor = "0-0"
        self._next_claim = 0.0  # sweep for abandoned entries on the first read
        # Sweep again after half the idle threshold: an abandoned entry waits at most 1.5x it.
        self._claim_every = max(0.05, min(cfg.claim_idle_ms / 2000, 5.0))
        self.ensure_group()

    def ensure_group(self) -> None:
        """Create the group (and the stream) if missing. From id 0: records written before any
        trainer started are still read."""
        try:
            self._client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def read(self, count: int | None = None, block_ms: int | None = None) -> list[Delivery]:
        """Up to `count` records: abandoned entries first (XAUTOCLAIM), else new ones, waiting
        up to block_ms (default cfg.block_ms; 0: not at all). May return [] even when entries
        were read (all dead-lettered or duplicates). Redis errors propagate."""
        count = count or READ_COUNT
        block = self.cfg.block_ms if block_ms is None else block_ms
        if block >= self.cfg.socket_timeout_s * 1000:
            raise ValueError(f"block_ms ({block}) must be shorter than socket_timeout_s")
        entries = self._claim(count)
        if entries:
            return self._handle(entries, claimed=True)
        return self._handle(self._read_new(count, block), claimed=False)

    def ack(self, deliveries: Iterable[Delivery | str]) -> int:
        """Mark records done (XACK); returns how many were pending. Unacked records are redelivered."""
        ids = [d.entry_id if isinstance(d, Delivery) else d for d in deliveries]
        if not ids:
            return 0
        n = int(self._client.xack(self.stream, self.group, *ids))
        self._held.difference_update(ids)
        self._stats.acked += n
        return n

    def keep_alive(self) -> int:
        """Reset the idle time of every entry this consumer holds (XCLAIM ... JUSTID, which does
        not count as a delivery), so XAUTOCLAIM only ever takes entries of consumers that stopped
        calling this: dead ones. Call it more often than claim_idle_ms. Returns entries touched."""
        held = sorted(self._held)
        for i in range(0, len(held), 500):
            self._client.xclaim(self.stream, self.group, self.name, 0, held[i:i + 500], justid=True)
        return len(held)

    def info(self) -> dict[str, Any]:
        """This group's XINFO GROUPS entry (name, consumers, pending, last-delivered-id, lag, ...)."""
        return group_info(self._client, self.stream).get(self.group, {})

    def lag(self) -> int | None:
        """Entries not yet delivered to the group (None if Redis cannot tell)."""
        lag = self.info().get("lag")
        return None if lag is None else int(lag)

    def pending(self) -> int:
        """Entries delivered to the group and not yet acked, across its consumers."""
        return int(self.info().get("pending", 0))

    def stats(self) -> ConsumerStats:
        s = self._stats
        return ConsumerStats(s.delivered, s.acked, s.claimed, s.duplicates, s.trimmed, dict(s.dead_lettered))

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "RecordConsumer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals --

    def _claim(self, count: int) -> list[tuple[Any, Any]]:
        now = time.monotonic()
        if self._claim_cursor == "0-0" and now < self._next_claim:
            return []
        resp = self._client.xautoclaim(self.stream, self.group, self.name, self.cfg.claim_idle_ms,
                                       start_id=self._claim_cursor, count=count)
        self._claim_cursor = _s(resp[0])
        if self._claim_cursor == "0-0":  # swept the whole pending list; rest a while
            self._next_claim = now + self._claim_every
        if len(resp) > 2 and resp[2]:
            # Redis 7 drops pending entries that MAXLEN trimmed and reports their ids here.
            self._stats.trimmed += len(resp[2])
        self._stats.claimed += len(resp[1])
        return resp[1]

    def _read_new(self, count: int, block: int) -> list[tuple[Any, Any]]:
        try:
            resp = self._client.xreadgroup(self.group, self.name, {self.stream: ">"}, count=count,
                                           block=block if block > 0 else None)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self.ensure_group()  # the stream or group was deleted (e.g. a Redis without persistence restarted)
            return []
        return resp[0][1] if resp else []  # [[stream, [(id, fields), ...]]]

    def _handle(self, entries: list[tuple[Any, Any]], claimed: bool) -> list[Delivery]:
        out: list[Delivery] = []
        to_ack: list[str] = []
        dead: list[tuple[str, str, str, dict]] = []
        for entry_id, fields in entries:
            eid = _s(entry_id)
            if claimed and eid in self._held:
                continue  # our own entry, still in the caller's hands: not abandoned, not redelivered
            if fields is None:  # deleted under us (Redis < 7 reports these inline)
                self._stats.trimmed += 1
                to_ack.append(eid)
                continue
            payload = fields.get(FIELD)
            if payload is None:
                dead.append((eid, "missing_field", f"entry has no {FIELD.decode()!r} field: {sorted(map(_s, fields))}",
                             fields))
                continue
            try:
                rec = decode(payload)
            except UnknownSchemaVersion as e:
                dead.append((eid, "unknown_version", str(e), fields))
                continue
            except RecordError as e:
                dead.append((eid, "corrupt", str(e), fields))
                continue
            except Exception as e:  # a decoder bug must not stop the group either
                dead.append((eid, "corrupt", f"{type(e).__name__}: {e}", fields))
                continue
            want = self.expect_target_sha256
            if want and rec.target_sha256 and rec.target_sha256 != want:
                dead.append((eid, "wrong_target", f"record {rec.record_id} was computed by target "
                             f"{rec.target_sha256[:12]}…, this trainer's is {want[:12]}…", fields))
                continue
            if DEDUPE_WINDOW:
                prev = self._seen.get(rec.record_id)
                if prev is not None and prev != eid:
                    # Another entry with this record: a resubmission. The first copy stays pending until
                    # the caller acks it, so acking this one loses nothing.
                    self._stats.duplicates += 1
                    to_ack.append(eid)
                    continue
                # prev == eid: the same entry again (held past claim_idle_ms): redeliver, at-least-once.
                self._seen[rec.record_id] = eid
                self._seen.move_to_end(rec.record_id)
                while len(self._seen) > DEDUPE_WINDOW:
                    self._seen.popitem(last=False)
            out.append(Delivery(eid, rec, claimed))
            self._held.add(eid)
        if dead:
            self._dead_letter(dead)
        if to_ack:
            self._client.xack(self.stream, self.group, *to_ack)
        self._stats.delivered += len(out)
        return out

    def _dead_letter(self, dead: list[tuple[str, str, str, dict]]) -> None:
        # MULTI: the copy and the ack land together or not at all (then the entry stays pending
        # and is retried), so a bad entry is never lost nor acked without its copy.
        pipe = self._client.pipeline(transaction=True)
        for eid, reason, error, fields in dead:
            log.warning("record consumer %s: %s entry %s -> %s: %s", self.name, reason, eid, self.dead_stream, error)
            copy = {b"reason": reason, b"error": error[:1000], b"original_id": eid, b"consumer": self.name}
            copy.update({b"orig." + (k if isinstance(k, bytes) else str(k).encode()): v for k, v in fields.items()})
            pipe.xadd(self.dead_stream, copy, maxlen=self.cfg.max_entries, approximate=True)
        pipe.xack(self.stream, self.group, *[d[0] for d in dead])
        pipe.execute()
        for _, reason, _, _ in dead:
            self._stats.dead_lettered[reason] = self._stats.dead_lettered.get(reason, 0) + 1
