"""Deleting records (issue 45) on a real redis-server: by tenant, user or request id, from the
stream and its dead-letter stream, with an audit entry; and least privilege: each role's ACL
user may do its part only (the producer cannot read what it wrote)."""

import contextlib

import pytest
import redis

from infra.config import OSDConfig, StreamConfig, redis_username
from infra.records.deletion import DEAD_FIELD, audit_deletion, delete_from_stream, delete_records
from infra.records.match import RecordMatch
from infra.records.schema import decode, encode
from infra.redis.acl import acl_line
from infra.registry import Registry
from infra.records.streams import FIELD, RecordConsumer, RecordProducer, connect, dead_letter_stream
from test_records_v2 import encode_old, make_record

pytestmark = pytest.mark.redis
STREAM = "osd:del"


def _fill(client):
    recs = [make_record(0, tenant="acme", user="alice"), make_record(1, tenant="acme", user="bob"),
            make_record(2, tenant="beta", user="alice")]
    for r in recs:
        client.xadd(STREAM, {FIELD: encode(r)})
    client.xadd(STREAM, {FIELD: encode_old(make_record(3), 2)})  # from before tenants: tenant default
    client.xadd(dead_letter_stream(STREAM), {b"reason": b"wrong_target", DEAD_FIELD: encode(make_record(4, tenant="acme"))})
    client.xadd(dead_letter_stream(STREAM), {b"reason": b"corrupt", DEAD_FIELD: b"garbage"})
    return recs


def _owners(client, key=STREAM, field=FIELD):
    return [(r.tenant, r.user) for r in (decode(f[field]) for _, f in client.xrange(key))]


def test_deletion_by_user_tenant_and_request_id_reaches_stream_and_dead_letters(redis_url):
    client = redis.Redis.from_url(redis_url)
    recs = _fill(client)
    got = delete_records(client, STREAM, RecordMatch(user="alice"))
    assert (got.stream, got.dead_letters) == (2, 0)
    assert _owners(client) == [("acme", "bob"), (None, None)]
    got = delete_records(client, STREAM, RecordMatch(tenant="acme"))
    assert (got.stream, got.dead_letters) == (1, 1)
    assert client.xlen(dead_letter_stream(STREAM)) == 1  # the undecodable one cannot be matched
    got = delete_records(client, STREAM, RecordMatch(request_id="req-3", tenant="default"))
    assert got.stream == 1 and client.xlen(STREAM) == 0
    assert recs[0].request_id == "req-0"


def test_the_admin_path_deletes_and_writes_an_audit_entry(redis_url, tmp_path):
    client = redis.Redis.from_url(redis_url)
    _fill(client)
    cfg = OSDConfig.model_validate({"state_dir": str(tmp_path), "stream": {"redis_url": redis_url, "stream": STREAM}})
    match = RecordMatch(tenant="beta")
    entry = audit_deletion(cfg, match, delete_from_stream(cfg, match), "cli")
    assert entry["deleted"] == {"stream": 1, "dead_letters": 0}
    log = Registry.from_config(cfg).audit_log()
    assert log[-1]["action"] == "delete_records" and log[-1]["match"] == {"tenant": "beta"}
    assert log[-1]["via"] == "cli" and "time" in log[-1]


@contextlib.contextmanager
def _acl_users(redis_url):
    admin = redis.Redis.from_url(redis_url)
    users = {}
    for role in ("producer", "trainer", "admin"):
        name, pw = redis_username(role), f"pw-{role}-123"
        admin.execute_command("ACL", "SETUSER", *acl_line(role, name, pw, STREAM).split()[1:])
        users[role] = {"password": pw}  # the client connects as osd-<role>
    try:
        yield users
    finally:
        admin.execute_command("ACL", "DELUSER", *[redis_username(role) for role in users])


def test_each_role_may_do_its_part_only(redis_url):
    with _acl_users(redis_url) as users:
        cfg = StreamConfig(stream=STREAM, users=users, block_ms=100, socket_timeout_s=1.0, connect_timeout_s=0.5,
                           retention_s=3600)
        with RecordProducer(redis_url, cfg) as producer:  # XADD, the lag's XINFO, retention's XTRIM
            assert producer.submit(make_record(7, tenant="acme")) and producer.flush(5)
            assert producer.stats().written == 1
        writer = connect(redis_url, cfg, role="producer")
        for read in (lambda: writer.xrange(STREAM), lambda: writer.xread({STREAM: "0"}),
                     lambda: writer.xrevrange(STREAM), lambda: writer.xdel(STREAM, "0-1"),
                     lambda: writer.get("other-key")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                read()
        consumer = RecordConsumer(redis_url, cfg, name="t")
        got = consumer.read(count=10)
        assert [d.record.tenant for d in got] == ["acme"] and consumer.ack(got) == 1
        trainer = connect(redis_url, cfg, role="trainer")
        with pytest.raises(redis.exceptions.NoPermissionError):
            trainer.xdel(STREAM, got[0].entry_id)
        assert delete_records(connect(redis_url, cfg, role="admin"), STREAM, RecordMatch(tenant="acme")).stream == 1


def test_osd_records_delete(redis_url, tmp_path, monkeypatch, capsys):
    from pipeline.cli import main

    client = redis.Redis.from_url(redis_url)
    _fill(client)
    for name, value in {"OSD_STREAM__REDIS_URL": redis_url, "OSD_STREAM__STREAM": STREAM,
                        "OSD_STATE_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)
    assert main(["records", "delete"]) == 2 and "name what to delete" in capsys.readouterr().err
    assert main(["records", "delete", "--tenant", "acme", "--user", "bob"]) == 0
    assert "deleted 1 record(s)" in capsys.readouterr().out
    assert ("acme", "bob") not in _owners(client)
    cfg = OSDConfig.model_validate({"state_dir": str(tmp_path)})
    assert Registry.from_config(cfg).audit_log()[-1]["match"] == {"tenant": "acme", "user": "bob"}


def test_the_trainer_role_counts_starts_and_reads_the_loops_health(redis_url):
    """The trainer ranks and the ops page connect as the trainer: each start is counted and
    stamped, and the ops page reads the counts, the stamps and the stream's health, under its ACL."""
    from infra.redis.loop_status import count_start
    from serve.api.ops.source import stream_health

    with _acl_users(redis_url) as users:
        cfg = StreamConfig(stream=STREAM, users=users, block_ms=100, socket_timeout_s=1.0, connect_timeout_s=0.5)
        trainer = connect(redis_url, cfg, role="trainer")
        assert count_start(trainer, STREAM, "trainer-0") == 1 and count_start(trainer, STREAM, "trainer-0") == 2
        health = stream_health(trainer, STREAM)
        assert health["starts"] == {"trainer-0": 2} and health["last_recovery"]["component"] == "trainer-0"
        with pytest.raises(redis.exceptions.NoPermissionError):
            trainer.hincrby("other-key", "x", 1)
