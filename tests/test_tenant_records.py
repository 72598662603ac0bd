"""A replica's records under tenants (issue 45), on a real redis-server: every record names
its tenant, user, request id and time; an opted-out request leaves nothing behind (stream,
dead letters, suffix indexes, INFO logs); tenants draft from indexes of their own, and
deletion reaches them."""

import asyncio
import logging
import time

import numpy as np
import pytest
import redis

from infra.config import load_config
from infra.records.schema import decode
from infra.records.streams import FIELD, dead_letter_stream

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("one_thread")]
STREAM = "test:tenants"
SECRET_PROMPT = "zebra quantum marmalade"


@pytest.fixture
def replica(redis_url, tmp_path):
    from serve.api.app import TargetReplica

    cfg = load_config(environ={}, overrides={
        "state_dir": str(tmp_path), "model": {"target": "tiny-random"},
        "serve": {"draft": "suffix", "max_new_tokens": 16,
                  "api_keys": [{"key": "acme-key-1", "tenant": "acme"}, {"key": "beta-key-1", "tenant": "beta"}]},
        "stream": {"redis_url": redis_url, "stream": STREAM}})
    rep = TargetReplica(cfg.model_dump(mode="json"))
    yield rep
    rep.close()


def _req(rid, tenant, record, user=None, prompt=SECRET_PROMPT):
    return {"kind": "completion", "prompt": prompt, "max_tokens": 12, "request_id": rid, "tenant": tenant,
            "user": user, "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None}, "stop": [],
            "record": record}


def _run(rep, req):
    out = asyncio.run(rep.generate(req))
    assert "error" not in out, out
    rep.producer.flush(5)
    return out


def _stored_bytes(redis_url):
    client = redis.Redis.from_url(redis_url)
    return [v for key in (STREAM, dead_letter_stream(STREAM)) for _, fields in client.xrange(key)
            for v in fields.values()]


def _pool_tokens(rep):
    return {pool: index.n_tokens for pool, index in rep.router.routing.stable_runner.proposer.pools.items()}


def test_a_record_names_its_tenant_user_request_and_time(replica, redis_url):
    t0 = time.time()
    out = _run(replica, _req("cmpl-1", "acme", True, user="alice"))
    rec = decode(_stored_bytes(redis_url)[0])
    assert (rec.tenant, rec.user, rec.request_id, rec.record_id) == ("acme", "alice", "cmpl-1", out["record_id"])
    assert t0 <= rec.created_at <= time.time()


def test_an_opted_out_request_leaves_nothing_behind(replica, redis_url, caplog, capsys):
    ids = np.asarray(replica.tokenizer.encode(SECRET_PROMPT, add_special_tokens=False), np.int32).tobytes()
    with caplog.at_level(logging.INFO):
        _run(replica, _req("cmpl-out", "acme", False))
    stored = _stored_bytes(redis_url)
    assert not any(ids in v or SECRET_PROMPT.encode() in v for v in stored)
    assert sum(_pool_tokens(replica).values()) == 0
    logged = caplog.text + "".join(capsys.readouterr())
    assert SECRET_PROMPT not in logged
    # The same request recorded is found by the same search: the search would have seen it.
    _run(replica, _req("cmpl-in", "acme", True))
    assert any(ids in v for v in _stored_bytes(redis_url)) and _pool_tokens(replica)["acme"] > 0


def test_tenants_draft_from_their_own_index_and_deletion_reaches_it(replica):
    _run(replica, _req("a1", "acme", True, user="alice"))
    _run(replica, _req("b1", "beta", True))
    pools = _pool_tokens(replica)
    assert pools["acme"] > 0 and pools["beta"] > 0 and pools[None] == 0
    proposer = replica.router.routing.stable_runner.proposer
    # One output each: a tenant's index holds its own tenant's output only.
    assert [len(proposer.pools[t].seq_ids()) for t in ("acme", "beta")] == [1, 1]
    assert replica.forget({"user": "alice"}) == {"replica": replica.replica_id, "removed": 1}
    assert _pool_tokens(replica)["acme"] == 0 and _pool_tokens(replica)["beta"] == pools["beta"]
