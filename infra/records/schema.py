"""The record of one served request: what the target computed, in a versioned Arrow schema.

Pure: pyarrow + numpy only, no Redis and no torch, so trainers and tools can read records
without the serving stack. One record is one Arrow IPC *stream* (schema message + one
record batch with one row). The schema travels with every payload, which costs ~1 KB per
record but makes each payload self-describing: a trainer can reject what it does not
understand without any side channel.

Layout (schema version 1), one row, N = generated positions, K = target top-k, P = prompt:
    record_id      string           uuid4 hex, unique per record (consumers dedupe on it)
    request_id     string
    created_at     float64          unix seconds
    draft_version  string           the draft that served the request
    domain         string, null ok  prompt domain tag
    prompt_ids     list<int32>                    [P]
    output_ids     list<int32>                    [N]  row i = the i-th emitted token
    topk_ids       list<fixed_size_list<int32>[K]>   [N, K]
    topk_logprobs  list<fixed_size_list<float16>[K]> [N, K] raw target log-probs
    accepted       list<bool>                     [N]  draft token accepted at i
    draft_tokens   list<int32>                    [N]  -1 where the draft proposed nothing
    draft_probs    list<float32>                  [N]  NaN where the draft proposed nothing
Schema version 2 adds, after `domain`:
    target_sha256  string, null ok  identity of the target that computed the record
                                    (infra.target.target_identity); consumers refuse records
                                    of other target weights (RecordConsumer expect_target_sha256)
Schema version 3 adds, after `target_sha256`, who the record belongs to (what deletion matches):
    tenant         string, null ok  the tenant of the API key that made the request
    user           string, null ok  the OpenAI `user` field the request named, if any
`encode` writes version 3; `decode` reads 1, 2 and 3 (a v1 record has target_sha256 None, a v1 or
v2 record tenant and user None), so a rolling upgrade does not dead-letter records already in
the stream.
The version lives in the schema metadata so it can be checked before any column is read.

Decoding is zero-copy for every numeric array except `accepted` (Arrow packs bools into
bits): the numpy arrays of a decoded Record are read-only views into the payload bytes,
which they keep alive.
"""

from __future__ import annotations

import functools
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

SCHEMA_VERSION = 3
READ_VERSIONS = (1, 2, 3)
VERSION_KEY = b"osd.record.version"


class RecordError(ValueError):
    """A record cannot be encoded or decoded."""


class CorruptRecord(RecordError):
    """The payload is not a valid record of a known version (truncated, garbage, bad columns)."""


class UnknownSchemaVersion(RecordError):
    """The payload is a record of a schema version this code does not read."""

    def __init__(self, version: Any):
        self.version = version
        super().__init__(f"unknown record schema version {version!r} (this code reads {READ_VERSIONS})")


class InvalidRecord(RecordError):
    """A Record being built or encoded has inconsistent fields (shapes, lengths)."""


def new_record_id() -> str:
    return uuid.uuid4().hex


@dataclass
class Record:
    """One served request. N rows of per-position arrays, K = top-k; see the module doc."""

    request_id: str
    draft_version: str
    prompt_ids: np.ndarray  # [P] int32
    output_ids: np.ndarray  # [N] int32
    topk_ids: np.ndarray  # [N, K] int32
    topk_logprobs: np.ndarray  # [N, K] float16
    accepted: np.ndarray  # [N] bool
    draft_tokens: np.ndarray  # [N] int32, -1 = none
    draft_probs: np.ndarray  # [N] float32, NaN = none
    domain: str | None = None
    target_sha256: str | None = None  # schema v2; None in v1 records
    tenant: str | None = None  # schema v3; None in v1 and v2 records
    user: str | None = None  # schema v3; the request's OpenAI `user`, None where it named none
    record_id: str = field(default_factory=new_record_id)
    created_at: float = field(default_factory=time.time)
    schema_version: int = SCHEMA_VERSION

    @property
    def n_positions(self) -> int:
        return int(self.output_ids.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.topk_ids.shape[1])


# -- schema -----------------------------------------------------------------------------

_META = [("record_id", pa.string()), ("request_id", pa.string()), ("created_at", pa.float64()),
         ("draft_version", pa.string()), ("domain", pa.string())]
_NULLABLE = frozenset({"domain", "target_sha256", "tenant", "user"})
_V2 = [("target_sha256", pa.string())]
_V3 = [("tenant", pa.string()), ("user", pa.string())]


def _added_columns(version: int) -> list[tuple[str, pa.DataType]]:
    # The metadata columns each version added after `domain`, in order.
    return (_V2 if version >= 2 else []) + (_V3 if version >= 3 else [])


@functools.lru_cache(maxsize=64)
def record_schema(top_k: int, version: int = 1) -> pa.Schema:
    """The Arrow schema of a record of `version` with top-k width `top_k`. The default stays 1:
    the teacher cache (train/teacher/data.py) stores tables of that schema."""
    return pa.schema(
        _META
        + _added_columns(version)
        + [
            ("prompt_ids", pa.list_(pa.int32())),
            ("output_ids", pa.list_(pa.int32())),
            ("topk_ids", pa.list_(pa.list_(pa.int32(), top_k))),
            ("topk_logprobs", pa.list_(pa.list_(pa.float16(), top_k))),
            ("accepted", pa.list_(pa.bool_())),
            ("draft_tokens", pa.list_(pa.int32())),
            ("draft_probs", pa.list_(pa.float32())),
        ],
        metadata={VERSION_KEY: str(version).encode()},
    )


_COLUMNS = {v: tuple(record_schema(1, v).names) for v in READ_VERSIONS}


# -- encode -----------------------------------------------------------------------------


def _arr(x: Any, dtype: type, name: str, ndim: int) -> np.ndarray:
    a = np.ascontiguousarray(x, dtype=dtype)
    if a.ndim != ndim:
        raise InvalidRecord(f"{name}: expected {ndim}-d array, got shape {a.shape}")
    return a


@functools.lru_cache(maxsize=4096)
def _offsets(n: int) -> pa.Array:
    # Immutable, so shared between records; building it costs more than the rest of a list column.
    return pa.array(np.array([0, n], np.int32))


def _one_row_list(values: pa.Array) -> pa.ListArray:
    # A single list cell spanning all of `values`; no copy of the values.
    return pa.ListArray.from_arrays(_offsets(len(values)), values)


def encode(record: Record) -> bytes:
    """Serialize a Record (current schema version). Raises InvalidRecord on bad shapes."""
    prompt = _arr(record.prompt_ids, np.int32, "prompt_ids", 1)
    out = _arr(record.output_ids, np.int32, "output_ids", 1)
    ids = _arr(record.topk_ids, np.int32, "topk_ids", 2)
    lps = _arr(record.topk_logprobs, np.float16, "topk_logprobs", 2)
    acc = _arr(record.accepted, np.bool_, "accepted", 1)
    dtok = _arr(record.draft_tokens, np.int32, "draft_tokens", 1)
    dprob = _arr(record.draft_probs, np.float32, "draft_probs", 1)
    n = out.shape[0]
    k = ids.shape[1]
    if ids.shape != (n, k) or lps.shape != (n, k):
        raise InvalidRecord(f"topk_ids {ids.shape} and topk_logprobs {lps.shape} must both be [N={n}, K]")
    if k < 1:
        raise InvalidRecord("top-k width must be >= 1")
    for name, a in (("accepted", acc), ("draft_tokens", dtok), ("draft_probs", dprob)):
        if a.shape[0] != n:
            raise InvalidRecord(f"{name} has {a.shape[0]} rows, output_ids has {n}")
    if not record.record_id or not isinstance(record.record_id, str):
        raise InvalidRecord("record_id must be a non-empty string")

    schema = record_schema(k, SCHEMA_VERSION)
    cols = [
        pa.array([record.record_id], pa.string()),
        pa.array([str(record.request_id)], pa.string()),
        pa.array([float(record.created_at)], pa.float64()),
        pa.array([str(record.draft_version)], pa.string()),
        pa.array([record.domain], pa.string()),
        pa.array([record.target_sha256], pa.string()),
        pa.array([record.tenant], pa.string()),
        pa.array([record.user], pa.string()),
        _one_row_list(pa.array(prompt)),
        _one_row_list(pa.array(out)),
        _one_row_list(pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1)), k)),
        _one_row_list(pa.FixedSizeListArray.from_arrays(pa.array(lps.reshape(-1)), k)),
        _one_row_list(pa.array(acc)),
        _one_row_list(pa.array(dtok)),
        _one_row_list(pa.array(dprob)),
    ]
    batch = pa.RecordBatch.from_arrays(cols, schema=schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


# -- decode -----------------------------------------------------------------------------


def payload_version(schema: pa.Schema) -> int:
    raw = (schema.metadata or {}).get(VERSION_KEY)
    if raw is None:
        raise CorruptRecord(f"schema metadata has no {VERSION_KEY.decode()!r} key (not an osd record)")
    try:
        return int(raw)
    except ValueError:
        raise UnknownSchemaVersion(raw.decode(errors="replace")) from None


def _check_schema(schema: pa.Schema, version: int) -> int:
    """Returns K; raises CorruptRecord naming what differs from `version`'s schema."""
    try:  # fast path: the schema this code writes
        k = schema.field("topk_ids").type.value_type.list_size
        if schema.equals(record_schema(k, version)):
            return k
    except (KeyError, AttributeError):
        pass
    names = schema.names
    missing = [c for c in _COLUMNS[version] if c not in names]
    extra = [c for c in names if c not in _COLUMNS[version]]
    if missing or extra:
        raise CorruptRecord(f"wrong columns: missing {missing}, unexpected {extra}")
    t = schema.field("topk_ids").type
    if not (pa.types.is_list(t) and pa.types.is_fixed_size_list(t.value_type)):
        raise CorruptRecord(f"column topk_ids has type {t}, expected list<fixed_size_list<int32>[K]>")
    k = t.value_type.list_size
    expected = record_schema(k, version)
    for f in expected:
        got = schema.field(f.name).type
        if not got.equals(f.type):
            raise CorruptRecord(f"column {f.name} has type {got}, expected {f.type}")
    if names != expected.names:
        raise CorruptRecord(f"columns out of order: {names}")
    return k


def _cell(col: pa.Array, name: str, k: int = 0, copy: bool = False) -> np.ndarray:
    """The one list cell of a one-row list column as numpy, checked for nulls.

    `.values` + the two offsets instead of `.flatten()`: same result, far cheaper for the
    one-row case (docs/benchmarks.md). k > 0: the cell holds fixed-size lists of k, returned flat [n * k]."""
    if col.null_count:
        raise CorruptRecord(f"column {name} is null")
    start, stop = (int(x) for x in col.offsets.to_numpy())
    vals = col.values  # ignores its own slice offset, hence the `base` below
    if k:
        if vals.null_count:
            raise CorruptRecord(f"column {name} has null rows")
        base = vals.offset
        vals, start, stop = vals.values, (base + start) * k, (base + stop) * k
    if vals.null_count:
        raise CorruptRecord(f"column {name} has null values")
    if not 0 <= start <= stop <= len(vals):
        raise CorruptRecord(f"column {name} has offsets {start}..{stop} outside its {len(vals)} values")
    return vals.to_numpy(zero_copy_only=not copy)[start:stop]


def decode(payload: bytes | memoryview | pa.Buffer) -> Record:
    """Parse a payload from `encode`. Numeric arrays are read-only views into `payload`.

    Raises UnknownSchemaVersion for a record of another version, CorruptRecord for
    anything else that is not a well-formed record; both are RecordError. (No checksum:
    a flipped bit inside a value decodes to a wrong value; the transport is TCP.)"""
    try:
        return _decode(payload)
    except RecordError:
        raise
    except Exception as e:  # whatever else a malformed payload trips (bad UTF-8 in a string, ...)
        raise CorruptRecord(f"undecodable payload ({len(payload)} bytes): {type(e).__name__}: {e}") from None


def _decode(payload: bytes | memoryview | pa.Buffer) -> Record:
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(payload))
    except (pa.ArrowException, OSError, TypeError, ValueError) as e:
        raise CorruptRecord(f"not an Arrow IPC stream ({len(payload)} bytes): {e}") from None
    version = payload_version(reader.schema)
    if version not in READ_VERSIONS:
        raise UnknownSchemaVersion(version)
    k = _check_schema(reader.schema, version)
    try:
        batch = reader.read_next_batch()
    except StopIteration:
        raise CorruptRecord("payload has a schema but no record batch (truncated?)") from None
    except (pa.ArrowException, OSError, ValueError) as e:
        raise CorruptRecord(f"record batch unreadable (truncated?): {e}") from None
    if batch.num_rows != 1:
        raise CorruptRecord(f"expected 1 row, got {batch.num_rows}")
    try:
        batch.validate()  # buffer sizes vs lengths; O(columns), not a full scan
    except pa.ArrowException as e:
        raise CorruptRecord(f"record batch invalid: {e}") from None

    c = {name: batch.column(i) for i, name in enumerate(batch.schema.names)}
    for name, _ in _META + _added_columns(version):
        if name not in _NULLABLE and c[name].null_count:
            raise CorruptRecord(f"column {name} is null")

    out = _cell(c["output_ids"], "output_ids")
    n = out.shape[0]
    ids = _cell(c["topk_ids"], "topk_ids", k)
    lps = _cell(c["topk_logprobs"], "topk_logprobs", k)
    acc = _cell(c["accepted"], "accepted", copy=True)  # Arrow bools are bits: unpacking copies
    dtok = _cell(c["draft_tokens"], "draft_tokens")
    dprob = _cell(c["draft_probs"], "draft_probs")
    if ids.shape[0] != n * k or lps.shape[0] != n * k:
        raise CorruptRecord(f"top-k columns have {ids.shape[0]} / {lps.shape[0]} values, expected {n}x{k}")
    for name, a in (("accepted", acc), ("draft_tokens", dtok), ("draft_probs", dprob)):
        if a.shape[0] != n:
            raise CorruptRecord(f"column {name} has {a.shape[0]} rows, output_ids has {n}")
    return Record(
        record_id=c["record_id"][0].as_py(),
        request_id=c["request_id"][0].as_py(),
        created_at=c["created_at"][0].as_py(),
        draft_version=c["draft_version"][0].as_py(),
        domain=c["domain"][0].as_py(),
        target_sha256=c["target_sha256"][0].as_py() if version >= 2 else None,
        tenant=c["tenant"][0].as_py() if version >= 3 else None,
        user=c["user"][0].as_py() if version >= 3 else None,
        prompt_ids=_cell(c["prompt_ids"], "prompt_ids"),
        output_ids=out,
        topk_ids=ids.reshape(n, k),
        topk_logprobs=lps.reshape(n, k),
        accepted=acc,
        draft_tokens=dtok,
        draft_probs=dprob,
        schema_version=version,
    )


# -- from the engine ----------------------------------------------------------------------


def record_from_capture(
    prompt_ids: Sequence[int] | np.ndarray,
    output_ids: Sequence[int] | np.ndarray,
    capture: Any,
    *,
    request_id: str,
    draft_version: str,
    domain: str | None = None,
    record_id: str | None = None,
    created_at: float | None = None,
    target_sha256: str | None = None,
    tenant: str | None = None,
    user: str | None = None,
) -> Record:
    """Build a Record from one request and its capture.

    `capture` is duck-typed on serve.capture.Capture (pipeline/ must not import serve/):
    topk_ids [N, K] int32, topk_logprobs [N, K] fp16, tokens [N], accepted [N] bool,
    draft_tokens [N] int32, draft_probs [N] float32. Row i of the capture is output_ids[i].
    Arrays already of the right dtype are kept without a copy."""
    out = np.asarray(output_ids, dtype=np.int32)
    n = len(capture.tokens)
    if out.shape != (n,):
        raise InvalidRecord(f"output_ids has shape {out.shape}, capture has {n} rows")
    rec = Record(
        request_id=str(request_id),
        draft_version=str(draft_version),
        domain=domain,
        prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
        output_ids=out,
        topk_ids=np.asarray(capture.topk_ids, dtype=np.int32),
        topk_logprobs=np.asarray(capture.topk_logprobs, dtype=np.float16),
        accepted=np.asarray(capture.accepted, dtype=np.bool_),
        draft_tokens=np.asarray(capture.draft_tokens, dtype=np.int32),
        draft_probs=np.asarray(capture.draft_probs, dtype=np.float32),
        target_sha256=target_sha256,
        tenant=tenant,
        user=user,
    )
    if record_id is not None:
        rec.record_id = record_id
    if created_at is not None:
        rec.created_at = float(created_at)
    k = rec.topk_ids.shape[1] if rec.topk_ids.ndim == 2 else -1
    shapes = {"topk_ids": rec.topk_ids.shape, "topk_logprobs": rec.topk_logprobs.shape,
              "accepted": rec.accepted.shape, "draft_tokens": rec.draft_tokens.shape,
              "draft_probs": rec.draft_probs.shape}
    want = {"topk_ids": (n, k), "topk_logprobs": (n, k), "accepted": (n,), "draft_tokens": (n,),
            "draft_probs": (n,)}
    bad = [f"{name} {shapes[name]}" for name in shapes if shapes[name] != want[name] or k < 1]
    if bad:
        raise InvalidRecord(f"capture arrays do not match {n} rows x K: {', '.join(bad)}")
    return rec
