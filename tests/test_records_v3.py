"""Record schema v3 (tenant, user: who a record belongs to, what deletion matches): v3 round
trips them, and v1 and v2 records still decode, with no owner."""

import numpy as np
import pytest

from infra.records.schema import SCHEMA_VERSION, decode, encode, record_from_capture
from test_records_v2 import encode_old, make_record

pytestmark = pytest.mark.pure


def test_v3_round_trips_tenant_and_user():
    rec = make_record(tenant="acme", user="u-42", target_sha256="ab" * 32)
    out = decode(encode(rec))
    assert SCHEMA_VERSION == 3 and out.schema_version == 3
    assert (out.tenant, out.user, out.target_sha256) == ("acme", "u-42", "ab" * 32)
    assert (out.request_id, out.created_at) == (rec.request_id, rec.created_at)
    bare = decode(encode(make_record()))
    assert bare.tenant is None and bare.user is None


@pytest.mark.parametrize("version", [1, 2])
def test_older_records_decode_with_no_owner(version):
    rec = make_record(tenant="acme", user="u-42", target_sha256="cd" * 32)
    old = decode(encode_old(rec, version))
    assert old.schema_version == version and old.tenant is None and old.user is None
    assert old.target_sha256 == (rec.target_sha256 if version == 2 else None)
    assert np.array_equal(old.output_ids, rec.output_ids) and old.record_id == rec.record_id


def test_record_from_capture_carries_the_owner():
    src = make_record(n=3)
    rec = record_from_capture(src.prompt_ids, src.output_ids, _Cap(src), request_id="chatcmpl-1",
                              draft_version="v1", tenant="acme", user="alice", created_at=12.5)
    out = decode(encode(rec))
    assert (out.tenant, out.user, out.request_id, out.created_at) == ("acme", "alice", "chatcmpl-1", 12.5)


class _Cap:
    def __init__(self, rec):
        self.topk_ids, self.topk_logprobs, self.tokens = rec.topk_ids, rec.topk_logprobs, rec.output_ids
        self.accepted, self.draft_tokens, self.draft_probs = rec.accepted, rec.draft_tokens, rec.draft_probs
