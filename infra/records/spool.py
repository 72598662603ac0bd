"""A record producer's on-disk spool: what a SIGKILL would otherwise take from its queue.

`RecordProducer.submit` hands a request its record id once the record is queued; the writer
thread XADDs it a few milliseconds later. A replica SIGKILLed in between (the OOM killer, a
node drain) took those records with it, uncounted. With a spool, `submit` first appends the
encoded record to this producer's own file (one `write(2)`: the kernel keeps the bytes when
the process dies; `sync` fdatasyncs them at most every FSYNC_S, for a power loss), and the
file is emptied once every record in it is written or counted as dropped.

A file whose producer died is adopted by the next producer on the same spool dir that looks
(a replica's restart, or any live replica within SCAN_S): producers hold an flock on their
own files, and the kernel drops it with the process, so a file that can be locked is an
orphan. Replay is idempotent: the producer writes each batch in a MULTI/EXEC with a marker,
`<stream>:spool:<spool id>` = the last frame written, and a replay skips frames at or below it
and moves the marker in the same transaction, so neither a batch cut off mid-flight nor a
replay killed half-way puts a record into the stream twice.

A file is a series of frames: MAGIC, payload length, CRC32, frame number (from 1, per spool),
then the payload (infra.records.encode). A torn last frame (killed mid-write, before the
request got its id) ends the file.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

MAGIC = b"OSP1"
_HEADER = struct.Struct("<4sIIQ")  # magic, payload bytes, crc32(payload), frame number
SUFFIX = ".spool"
# A file is emptied when every record in it is done; under a load that never lets it drain,
# the producer starts a new file past this size and deletes the old one once it is done.
SEGMENT_BYTES = 64 << 20
# Bytes appended are fdatasynced at most this often (the writer thread, never a request): a
# SIGKILL loses nothing (the page cache outlives the process), a power loss at most this much.
FSYNC_S = 1.0
# How often a producer looks for files dead producers left.
SCAN_S = 5.0
# The marker of a spool outlives its producer by this, then Redis forgets it.
MARKER_TTL_S = 7 * 24 * 3600


class SpoolError(ValueError):
    pass


def marker_key(stream: str, spool_id: str) -> str:
    """The Redis key holding the last frame of spool `spool_id` written to `stream`."""
    return f"{stream}:spool:{spool_id}"


def marker_pattern(stream: str) -> str:
    """The ACL key pattern of every spool marker of `stream`."""
    return f"{stream}:spool:*"


def frame(number: int, payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, len(payload), zlib.crc32(payload), number) + payload


def read_frames(data: bytes) -> list[tuple[int, bytes]]:
    """(frame number, payload) of each whole frame of a spool file's bytes, in order; a torn or
    corrupt frame ends the list (nothing after it was acknowledged to anyone)."""
    out, at = [], 0
    while at + _HEADER.size <= len(data):
        magic, n, crc, number = _HEADER.unpack_from(data, at)
        payload = data[at + _HEADER.size: at + _HEADER.size + n]
        if magic != MAGIC or len(payload) != n or zlib.crc32(payload) != crc:
            break
        out.append((number, bytes(payload)))
        at += _HEADER.size + n
    return out


@dataclass(eq=False)
class Segment:
    path: Path
    fd: int
    size: int = 0
    pending: int = 0  # records appended here, not yet written or dropped
    dirty: bool = False  # bytes appended since the last fdatasync


class Spool:
    """This producer's spool files in `directory`. Thread-safe: `append` from request threads,
    the rest from the writer thread."""

    def __init__(self, directory: Path | str, *, segment_bytes: int = SEGMENT_BYTES, fsync_s: float = FSYNC_S):
        if segment_bytes < 1:
            raise SpoolError(f"segment_bytes must be >= 1, got {segment_bytes}")
        if not fsync_s >= 0:
            raise SpoolError(f"fsync_s must be >= 0, got {fsync_s}")
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SpoolError(f"cannot create the record spool dir {self.dir}: {e}") from e
        self.id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.segment_bytes, self.fsync_s = segment_bytes, fsync_s
        self._lock = threading.Lock()
        self._number = 0
        self._segments: list[Segment] = []
        self._synced_at = float("-inf")
        self._made = 0  # segment files made, for the next one's name
        self._new_segment()

    def _new_segment(self) -> Segment:
        path = self.dir / f"{self.id}.{self._made:06d}{SUFFIX}"
        self._made += 1
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # ours while this process lives (see orphans)
        seg = Segment(path, fd)
        self._segments.append(seg)
        return seg

    def append(self, payload: bytes) -> tuple[Segment, int]:
        """Write one record; returns its segment (for `done`) and frame number. Raises OSError
        (a full disk): the caller queues the record unspooled rather than fail the request."""
        with self._lock:
            seg = self._segments[-1]
            if seg.size >= self.segment_bytes and seg.pending:
                seg = self._new_segment()
            number = self._number + 1
            data = frame(number, payload)
            written = 0
            try:
                while written < len(data):
                    written += os.write(seg.fd, data[written:])
            except OSError:
                if written:  # cut the torn frame off, so the frames after it stay readable
                    os.ftruncate(seg.fd, seg.size)
                raise
            self._number = number
            seg.size += len(data)
            seg.pending += 1
            seg.dirty = True
            return seg, number

    def done(self, segments: list[Segment]) -> None:
        """These records (one entry each) are written or counted as dropped: a file with none
        left is emptied (the current one) or deleted (an older one)."""
        with self._lock:
            for seg in segments:
                seg.pending -= 1
            for seg in list(self._segments):
                if seg.pending or not seg.size:
                    continue
                if seg is self._segments[-1]:
                    os.ftruncate(seg.fd, 0)
                    seg.size, seg.dirty = 0, False
                else:
                    self._drop(seg)

    def _drop(self, seg: Segment) -> None:
        seg.path.unlink(missing_ok=True)
        os.close(seg.fd)
        self._segments.remove(seg)

    def sync(self, now: float | None = None) -> None:
        """fdatasync what was appended since the last one, at most every fsync_s."""
        now = time.monotonic() if now is None else now
        if now < self._synced_at + self.fsync_s:
            return
        self._synced_at = now
        with self._lock:
            dirty = [s for s in self._segments if s.dirty]
            for s in dirty:
                s.dirty = False
        for s in dirty:
            try:
                os.fdatasync(s.fd)
            except OSError as e:  # a closed or failing file: the page cache still has it
                log.warning("record spool: fdatasync of %s failed: %s", s.path, e)

    @property
    def pending(self) -> int:
        with self._lock:
            return sum(s.pending for s in self._segments)

    def close(self) -> int:
        """Delete the files if every record is done, else leave them for the next producer to
        replay. Returns how many records are left in them."""
        with self._lock:
            left = sum(s.pending for s in self._segments)
            for seg in list(self._segments):
                if left:
                    os.fsync(seg.fd)
                    os.close(seg.fd)
                    self._segments.remove(seg)
                else:
                    self._drop(seg)
            return left


@dataclass
class Orphan:
    """The files a dead producer left, locked by the adopter until `release`."""
    spool_id: str
    fds: list[int]
    paths: list[Path]
    frames: list[tuple[int, bytes]] = field(default_factory=list)

    def remove(self) -> None:
        for p in self.paths:
            p.unlink(missing_ok=True)
        self.release()

    def release(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def orphans(directory: Path | str, own_id: str = "") -> Iterator[Orphan]:
    """The spools in `directory` whose producer is gone (their flock can be taken), each locked
    by this process while the caller replays it. A spool still being adopted by another
    producer, or deleted meanwhile, is skipped."""
    by_id: dict[str, list[Path]] = {}
    for p in sorted(Path(directory).glob(f"*{SUFFIX}")):
        spool_id = p.name[: -len(SUFFIX)].rsplit(".", 1)[0]
        if spool_id != own_id:
            by_id.setdefault(spool_id, []).append(p)
    for spool_id, paths in by_id.items():
        got = Orphan(spool_id, [], [])
        for p in paths:
            try:
                fd = os.open(p, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # Locked, but another adopter may have replayed and deleted it first.
                if os.fstat(fd).st_ino != os.stat(p).st_ino:
                    raise FileNotFoundError(p)
            except OSError:  # held by a live producer or an adopter, or gone
                os.close(fd)
                continue
            got.fds.append(fd)
            got.paths.append(p)
        if not got.paths:
            continue
        if len(got.paths) < len(paths):  # part of it is still held: its producer lives
            got.release()
            continue
        for fd in got.fds:
            with os.fdopen(os.dup(fd), "rb") as f:
                got.frames.extend(read_frames(f.read()))
        got.frames.sort(key=lambda f: f[0])
        yield got
