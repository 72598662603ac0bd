"""Record schema v2 (target_sha256): v1 and v2 both decode; a consumer bound to a target
dead-letters records of other target weights with a clear reason and never hands them out."""

import numpy as np
import pyarrow as pa
import pytest
import redis

from infra.config import StreamConfig
from infra.records.schema import SCHEMA_VERSION, VERSION_KEY, Record, decode, encode, record_schema
from infra.records.streams import FIELD, RecordConsumer, dead_letter_stream


def make_record(i: int = 0, n: int = 6, k: int = 3, **over) -> Record:
    rng = np.random.default_rng(i)
    fields = dict(request_id=f"req-{i}", draft_version="v1", prompt_ids=np.arange(4, dtype=np.int32),
                  output_ids=rng.integers(0, 100, n).astype(np.int32),
                  topk_ids=rng.integers(0, 100, (n, k)).astype(np.int32),
                  topk_logprobs=(-rng.random((n, k))).astype(np.float16), accepted=rng.random(n) < 0.5,
                  draft_tokens=np.full(n, -1, np.int32), draft_probs=np.full(n, np.nan, np.float32))
    return Record(**{**fields, **over})


LATER_COLUMNS = {1: ["target_sha256", "tenant", "user"], 2: ["tenant", "user"]}


def encode_old(rec: Record, version: int) -> bytes:
    """A payload as version-1 or -2 code wrote it: without the columns later versions added,
    its version in the metadata."""
    batch = pa.ipc.open_stream(encode(rec)).read_next_batch().drop_columns(LATER_COLUMNS[version])
    schema = record_schema(rec.top_k, version)
    assert batch.schema.remove_metadata().equals(schema.remove_metadata())
    batch = batch.replace_schema_metadata({VERSION_KEY: str(version).encode()})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def encode_v1(rec: Record) -> bytes:
    return encode_old(rec, 1)


@pytest.mark.pure
def test_v2_round_trips_target_sha256_and_v1_still_decodes():
    rec = make_record(target_sha256="ab" * 32)
    out = decode(encode(rec))
    assert SCHEMA_VERSION >= 2 and out.schema_version == SCHEMA_VERSION and out.target_sha256 == "ab" * 32
    assert decode(encode(make_record())).target_sha256 is None
    old = decode(encode_v1(rec))
    assert old.schema_version == 1 and old.target_sha256 is None
    assert np.array_equal(old.topk_ids, rec.topk_ids) and old.record_id == rec.record_id


@pytest.mark.redis
def test_consumer_dead_letters_records_of_another_target(redis_url):
    c = StreamConfig(block_ms=100, socket_timeout_s=1.0, connect_timeout_s=0.5)
    r = redis.Redis.from_url(redis_url)
    mine, other, legacy = "a" * 64, "b" * 64, make_record(3)
    good = make_record(1, target_sha256=mine)
    bad = make_record(2, target_sha256=other)
    ids = [r.xadd(c.stream, {FIELD: p}) for p in (encode(good), encode(bad), encode_v1(legacy))]
    consumer = RecordConsumer(redis_url, c, name="t", expect_target_sha256=mine)
    got = consumer.read(count=10)
    assert [d.record.record_id for d in got] == [good.record_id, legacy.record_id]
    dead = r.xrange(dead_letter_stream(c.stream))
    assert [e[1][b"original_id"] for e in dead] == [ids[1]]
    assert dead[0][1][b"reason"] == b"wrong_target" and b"bbbbbbbbbbbb" in dead[0][1][b"error"]
    assert consumer.stats().dead_lettered == {"wrong_target": 1}
