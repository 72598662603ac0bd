import uuid
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from infra.records.schema import (
    SCHEMA_VERSION,
    VERSION_KEY,
    CorruptRecord,
    InvalidRecord,
    Record,
    RecordError,
    UnknownSchemaVersion,
    decode,
    encode,
    record_from_capture,
)

pytestmark = pytest.mark.pure


def make_record(n=12, k=5, seed=0, **over) -> Record:
    rng = np.random.default_rng(seed)
    accepted = rng.random(n) < 0.5
    draft_tokens = np.where(rng.random(n) < 0.7, rng.integers(0, 49152, n), -1).astype(np.int32)
    draft_probs = np.where(draft_tokens >= 0, rng.random(n), np.nan).astype(np.float32)
    fields = dict(
        request_id=f"req-{seed}",
        draft_version="draft-v7",
        domain="code",
        prompt_ids=rng.integers(0, 49152, 9).astype(np.int32),
        output_ids=rng.integers(0, 49152, n).astype(np.int32),
        topk_ids=rng.integers(0, 49152, (n, k)).astype(np.int32),
        topk_logprobs=(-rng.random((n, k)) * 20).astype(np.float16),
        accepted=accepted,
        draft_tokens=draft_tokens,
        draft_probs=draft_probs,
    )
    fields.update(over)
    return Record(**fields)


def rewrite(payload: bytes, *, metadata=None, batch_fn=None) -> bytes:
    """Re-serialize a payload with other schema metadata and/or a transformed batch."""
    batch = pa.ipc.open_stream(payload).read_next_batch()
    if batch_fn is not None:
        batch = batch_fn(batch)
    if metadata is not None:
        batch = batch.replace_schema_metadata(metadata)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def assert_same(a: Record, b: Record) -> None:
    for name in ("record_id", "request_id", "created_at", "draft_version", "domain", "schema_version"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("prompt_ids", "output_ids", "topk_ids", "accepted", "draft_tokens"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name
    # fp16 / fp32 compared bit for bit: exact, NaN where NaN.
    assert b.topk_logprobs.dtype == np.float16
    assert np.array_equal(a.topk_logprobs.view(np.uint16), b.topk_logprobs.view(np.uint16))
    assert np.array_equal(a.draft_probs.view(np.uint32), b.draft_probs.view(np.uint32))


def test_round_trip_all_fields():
    rec = make_record()
    # Special values that must survive untouched.
    rec.topk_logprobs[0, :3] = [-np.inf, np.float16(-65504), np.float16(-6e-8)]
    rec.draft_tokens[1], rec.draft_probs[1] = -1, np.nan
    out = decode(encode(rec))
    assert_same(rec, out)
    assert out.schema_version == SCHEMA_VERSION
    assert (out.n_positions, out.top_k) == (12, 5)
    assert np.isnan(out.draft_probs[out.draft_tokens == -1]).all()
    # uuid4 hex: 32 lowercase hex digits that parse back to a version-4, RFC 4122 UUID
    parsed = uuid.UUID(hex=rec.record_id)
    assert parsed.hex == rec.record_id and parsed.version == 4 and parsed.variant == uuid.RFC_4122
    assert make_record().record_id != rec.record_id


def test_empty_generation_no_domain_and_input_dtypes_are_normalised():
    rec = make_record(n=0, k=3, domain=None)
    out = decode(encode(rec))
    assert out.domain is None and out.topk_ids.shape == (0, 3) and out.output_ids.shape == (0,)
    # int64 / float32 inputs (as from lists or torch) are stored in the schema's dtypes.
    rec = make_record(output_ids=list(range(12)), topk_logprobs=np.zeros((12, 5), np.float32))
    out = decode(encode(rec))
    assert out.output_ids.dtype == np.int32 and out.topk_logprobs.dtype == np.float16


def test_decode_is_a_zero_copy_view_of_the_payload():
    payload = encode(make_record(n=64, k=32))
    out = decode(payload)
    raw = np.frombuffer(payload, np.uint8)
    lo = raw.__array_interface__["data"][0]
    for name in ("prompt_ids", "output_ids", "topk_ids", "topk_logprobs", "draft_tokens", "draft_probs"):
        arr = getattr(out, name)
        addr = arr.__array_interface__["data"][0]
        assert lo <= addr and addr + arr.nbytes <= lo + len(payload), f"{name} was copied"
        assert not arr.flags.writeable


@pytest.mark.parametrize("cut", [0, 1, 8, 100, 300, -500, -60, -9])
def test_truncated_payload_is_corrupt(cut):
    payload = encode(make_record(n=32, k=8))
    with pytest.raises(CorruptRecord):
        decode(payload[:cut])


def test_garbage_is_corrupt():
    rng = np.random.default_rng(1)
    for blob in [b"", b"hello", rng.bytes(64), rng.bytes(5000), b"\xff\xff\xff\xff" + rng.bytes(100)]:
        with pytest.raises(CorruptRecord):
            decode(blob)
    # Byte noise anywhere in a real payload: a RecordError (or, in a value, a wrong value), never
    # another exception type.
    payload = bytearray(encode(make_record()))
    for i in range(0, len(payload), 7):
        bad = bytearray(payload)
        bad[i] ^= 0xA5
        try:
            decode(bytes(bad))
        except RecordError:
            pass


def test_wrong_columns_are_corrupt_and_named():
    payload = encode(make_record())
    meta = {VERSION_KEY: str(SCHEMA_VERSION).encode()}
    with pytest.raises(CorruptRecord, match=r"missing \['accepted'\]"):
        decode(rewrite(payload, metadata=meta, batch_fn=lambda b: b.drop_columns(["accepted"])))
    with pytest.raises(CorruptRecord, match=r"unexpected \['extra'\]"):
        decode(rewrite(payload, metadata=meta, batch_fn=lambda b: b.append_column("extra", pa.array([1]))))

    def retype(b):
        i = b.schema.get_field_index("draft_probs")
        return b.set_column(i, "draft_probs", b.column(i).cast(pa.list_(pa.float64())))

    with pytest.raises(CorruptRecord, match="column draft_probs has type"):
        decode(rewrite(payload, metadata=meta, batch_fn=retype))
    with pytest.raises(CorruptRecord, match="expected 1 row, got 2"):
        decode(rewrite(payload, metadata=meta, batch_fn=lambda b: pa.concat_batches([b, b])))
    # A plain Arrow table that is not a record at all.
    other = pa.record_batch({"x": [1, 2]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, other.schema) as w:
        w.write_batch(other)
    with pytest.raises(CorruptRecord, match="osd.record.version"):
        decode(sink.getvalue().to_pybytes())


def test_inconsistent_lengths_in_payload_are_corrupt():
    payload = encode(make_record(n=6))

    def short_accepted(b):
        i = b.schema.get_field_index("accepted")
        return b.set_column(i, "accepted", pa.array([[True, False]]))

    with pytest.raises(CorruptRecord, match="accepted has 2 rows, output_ids has 6"):
        decode(rewrite(payload, metadata={VERSION_KEY: str(SCHEMA_VERSION).encode()}, batch_fn=short_accepted))


@pytest.mark.parametrize("version", [b"99", b"0", b"two"])
def test_unknown_schema_version(version):
    payload = rewrite(encode(make_record()), metadata={VERSION_KEY: version})
    with pytest.raises(UnknownSchemaVersion, match=version.decode()) as e:
        decode(payload)
    assert isinstance(e.value, RecordError) and not isinstance(e.value, CorruptRecord)


def test_encode_rejects_inconsistent_shapes():
    with pytest.raises(InvalidRecord, match="topk_logprobs"):
        encode(make_record(topk_logprobs=np.zeros((12, 4), np.float16)))
    with pytest.raises(InvalidRecord, match="draft_probs has 3 rows"):
        encode(make_record(draft_probs=np.zeros(3, np.float32)))
    with pytest.raises(InvalidRecord, match="2-d"):
        encode(make_record(topk_ids=np.zeros(12, np.int32)))


def _capture(n=7, k=4, seed=3):
    rng = np.random.default_rng(seed)
    return dict(
        topk_ids=rng.integers(0, 100, (n, k)).astype(np.int32),
        topk_logprobs=(-rng.random((n, k))).astype(np.float16),
        tokens=rng.integers(0, 100, n).astype(np.int32),
        accepted=np.array([True, True, False, True, False, False, False][:n]),
        draft_tokens=np.array([5, 6, 7, 8, 9, -1, -1][:n], np.int32),
        draft_probs=np.array([0.9, 0.8, 0.3, 0.7, 0.2, np.nan, np.nan][:n], np.float32),
    )


def test_record_from_capture_duck_typed():
    cap = SimpleNamespace(**_capture())
    rec = record_from_capture([1, 2, 3], cap.tokens, cap, request_id="r1", draft_version="v2", domain="math",
                              record_id="abc", created_at=123.5)
    assert rec.topk_ids is cap.topk_ids  # right dtype already: no copy
    out = decode(encode(rec))
    assert (out.record_id, out.request_id, out.draft_version, out.domain, out.created_at) == (
        "abc", "r1", "v2", "math", 123.5)
    assert out.prompt_ids.tolist() == [1, 2, 3] and np.array_equal(out.output_ids, cap.tokens)
    assert np.array_equal(out.topk_logprobs.view(np.uint16), cap.topk_logprobs.view(np.uint16))
    assert out.draft_tokens.tolist()[-2:] == [-1, -1] and np.isnan(out.draft_probs[-2:]).all()

    with pytest.raises(InvalidRecord, match="capture has 7 rows"):
        record_from_capture([1], [1, 2], cap, request_id="r", draft_version="v")
    bad = SimpleNamespace(**{**_capture(), "draft_probs": np.zeros(3, np.float32)})
    with pytest.raises(InvalidRecord, match="draft_probs"):
        record_from_capture([1], bad.tokens, bad, request_id="r", draft_version="v")


def test_record_from_real_capture_class():
    from serve.engine.capture import Capture

    cap = Capture(**_capture())
    rec = record_from_capture([4, 5], cap.tokens, cap, request_id="r", draft_version="v1")
    assert decode(encode(rec)).n_positions == len(cap)


def test_codec_stays_pure():
    # Trainers and tools read records without the serving stack or a Redis client.
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, infra.records.schema; print([m for m in ('redis', 'torch', 'serve') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], check=True,
                         capture_output=True, text=True).stdout
    assert out.strip() == "[]"
