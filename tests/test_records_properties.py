"""Property tests of the record codec (infra/records/schema.py): any valid record round-trips bit
for bit, and any damaged payload is either decoded to a shape-consistent record or refused
with RecordError, never another exception.

A trainer reads records off a stream it does not control; a payload that made `decode` raise
something other than RecordError would crash it instead of being skipped and counted.
"""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from infra.records.schema import Record, RecordError, decode, encode

pytestmark = pytest.mark.pure

# No example database (it would write .hypothesis/ into the work tree); no deadline (tests
# assert behaviour, not timings).
PROPS = settings(max_examples=200, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

INT32 = np.iinfo(np.int32)
text = st.text(max_size=30)  # no lone surrogates: Arrow strings are UTF-8


@st.composite
def records(draw) -> Record:
    """Any record `encode` accepts: N positions (0 included), top-k width K >= 1, every value
    of each dtype (NaN, inf and negative zero included for the floats)."""
    n = draw(st.integers(0, 40))
    k = draw(st.integers(1, 8))
    ints = st.integers(INT32.min, INT32.max)
    return Record(
        record_id=draw(text.filter(bool)),
        request_id=draw(text),
        created_at=draw(st.floats()),
        draft_version=draw(text),
        domain=draw(st.none() | text),
        prompt_ids=draw(hnp.arrays(np.int32, draw(st.integers(0, 40)), elements=ints)),
        output_ids=draw(hnp.arrays(np.int32, n, elements=ints)),
        topk_ids=draw(hnp.arrays(np.int32, (n, k), elements=ints)),
        topk_logprobs=draw(hnp.arrays(np.float16, (n, k), elements=st.floats(width=16))),
        accepted=draw(hnp.arrays(np.bool_, n)),
        draft_tokens=draw(hnp.arrays(np.int32, n, elements=ints)),
        draft_probs=draw(hnp.arrays(np.float32, n, elements=st.floats(width=32))),
    )


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    # Bitwise, so NaN payloads and -0.0 count: the codec must not normalise floats.
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@PROPS
@given(rec=records())
def test_any_valid_record_round_trips_exactly(rec):
    got = decode(encode(rec))
    for name in ("record_id", "request_id", "draft_version", "domain", "schema_version"):
        assert getattr(got, name) == getattr(rec, name), name
    assert got.created_at == rec.created_at or (math.isnan(got.created_at) and math.isnan(rec.created_at))
    for name in ("prompt_ids", "output_ids", "topk_ids", "topk_logprobs", "accepted", "draft_tokens",
                 "draft_probs"):
        assert same_bits(getattr(got, name), getattr(rec, name)), name
    assert encode(got) == encode(rec)


def consistent(rec: Record) -> None:
    """A record decode returned is usable: every per-position array has N rows, top-k is N x K."""
    n, k = rec.n_positions, rec.top_k
    assert k >= 1
    assert rec.topk_ids.shape == rec.topk_logprobs.shape == (n, k)
    assert rec.accepted.shape == rec.draft_tokens.shape == rec.draft_probs.shape == (n,)
    assert rec.prompt_ids.ndim == 1


def decode_or_refuse(payload: bytes) -> None:
    try:
        rec = decode(payload)
    except RecordError:
        return
    consistent(rec)


@st.composite
def damaged(draw) -> bytes:
    """A real payload, cut short, with bytes overwritten, or with bytes spliced in."""
    payload = bytearray(encode(draw(records())))
    how = draw(st.sampled_from(["truncate", "overwrite", "insert"]))
    at = draw(st.integers(0, len(payload) - 1))
    if how == "truncate":
        return bytes(payload[:at])
    junk = draw(st.binary(min_size=1, max_size=16))
    if how == "overwrite":
        payload[at:at + len(junk)] = junk
    else:
        payload[at:at] = junk
    return bytes(payload)


@PROPS
@given(payload=damaged())
def test_damaged_payloads_are_refused_with_record_error_or_decode_consistently(payload):
    decode_or_refuse(payload)


@PROPS
@given(payload=st.binary(max_size=2000))
def test_arbitrary_bytes_are_refused_with_record_error(payload):
    with pytest.raises(RecordError):
        decode(payload)
