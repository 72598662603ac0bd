"""Tenants (issue 45): a key names its tenant, the tenant's policy decides what is recorded,
and each tenant drafts from a suffix index of its own unless it shares."""

import asyncio

import pytest

from infra.config import ConfigError, load_config
from infra.records.match import RecordMatch
from serve.api.proxy_auth import APIKeyMiddleware, tenant_keys_from
from serve.spec_decode.suffix.index import SuffixProposer
from serve.engine.tenancy import SHARED_POOL, Caller, KeyRing, Origin, origin_of, record_decision, suffix_pool

pytestmark = pytest.mark.pure

KEYS = [{"key": "acme-key-1", "tenant": "acme"}, {"key": "beta-key-1", "tenant": "beta"},
        {"key": "root-key-1", "tenant": "ops", "admin": True}]


def _serve(**over):
    return load_config(environ={}, overrides={"serve": {"api_keys": KEYS, **over}}).serve


def test_each_key_names_its_tenant_and_the_legacy_key_is_the_default_admin():
    ring = KeyRing(_serve(), legacy_key="legacy-key")
    assert ring.caller("Bearer acme-key-1") == Caller("acme", False)
    assert ring.caller("Bearer root-key-1") == Caller("ops", True)
    assert ring.caller("Bearer legacy-key") == Caller("default", True)
    assert ring.caller("Bearer nope") is None and ring.caller("") is None
    assert KeyRing(load_config(environ={}).serve, None).caller("") == Caller("default", True)  # no keys: local use


@pytest.mark.parametrize("policy,choice,want", [
    ("always", False, True), ("always", None, True),
    ("never", True, False), ("never", None, False),
    ("default-on", None, True), ("default-on", False, False), ("default-on", True, True),
    ("default-off", None, False), ("default-off", True, True), ("default-off", False, False),
])
def test_the_tenants_policy_decides_over_the_clients_choice(policy, choice, want):
    assert record_decision(policy, choice) is want


def test_a_tenant_without_a_policy_follows_serve_record():
    cfg = _serve(tenants={"acme": {"record": "never"}}, record=False)
    assert cfg.record_policy("acme") == "never" and cfg.record_policy("beta") == "default-off"
    assert _serve().record_policy("beta") == "default-on"


def test_bad_tenant_config_is_refused_without_showing_keys():
    with pytest.raises(ConfigError, match="record") as e:
        load_config(environ={}, overrides={"serve": {"tenants": {"acme": {"record": "sometimes"}}}})
    with pytest.raises(ConfigError, match="share a key") as e:
        load_config(environ={}, overrides={"serve": {"api_keys": KEYS + [{"key": "acme-key-1", "tenant": "x"}]}})
    assert "acme-key-1" not in str(e.value)
    with pytest.raises(ConfigError, match="tenant names"):
        load_config(environ={}, overrides={"serve": {"tenants": {"no spaces": {}}}})


def test_pools_are_per_tenant_once_keys_name_tenants_and_shared_where_a_tenant_says():
    cfg = _serve(tenants={"beta": {"share_suffix": True}})
    assert suffix_pool(cfg, "acme") == "acme" and suffix_pool(cfg, "beta") is SHARED_POOL
    assert suffix_pool(load_config(environ={}).serve, "default") is SHARED_POOL  # one tenant, one index
    assert origin_of(cfg, None, "u", "r1") == Origin("default", "u", "r1", "default")


def test_tenant_b_never_drafts_from_tenant_as_outputs():
    p = SuffixProposer(1000, max_depth=8)
    answer = list(range(100, 130))
    p.start("a1", [1, 2, 3], pool="acme")
    p.extend("a1", answer)
    p.finish("a1", add_to_global=True, tag=Origin("acme", None, "a1", "acme"))
    for req, pool in (("a2", "acme"), ("b1", "beta")):
        p.start(req, [1, 2, 3], pool=pool)
    assert p.propose("a2", max_tokens=8).tokens == answer[:3]  # acme's repeat drafts its own output (3: the match)
    got = p.propose("b1", max_tokens=8)
    assert got.tokens == [] and p.pools["beta"].n_tokens == 0 and p.global_index.n_tokens == 0


def test_forget_removes_the_named_outputs_from_their_pool():
    p = SuffixProposer(1000, max_depth=8)
    for i, (tenant, user) in enumerate([("acme", "alice"), ("acme", "bob"), ("beta", "alice")]):
        p.remember([1, 2], [10 + i] * 5, pool=tenant, tag=Origin(tenant, user, f"r{i}", tenant))
    assert p.forget(RecordMatch(tenant="acme", user="alice").matches_owner) == 1
    assert p.pools["acme"].n_tokens == 7 and p.pools["beta"].n_tokens == 7
    assert p.forget(RecordMatch(user="alice").matches_owner) == 1 and p.pools["beta"].n_tokens == 0
    assert p.forget(RecordMatch(request_id="r1").matches_owner) == 1 and p.pools["acme"].n_tokens == 0


def test_a_match_names_something_and_old_records_are_the_default_tenant():
    with pytest.raises(ValueError, match="name what to delete"):
        RecordMatch()
    assert RecordMatch(tenant="default").matches(None, None, "r")
    assert not RecordMatch(tenant="acme", user="u").matches("acme", "v", "r")


def test_the_proxy_accepts_every_tenants_key():
    env = {"OSD_SERVE__API_KEYS": "[{key: acme-key-1, tenant: acme}, {key: beta-key-1, admin: true}]"}
    assert tenant_keys_from(env) == [("acme-key-1", False), ("beta-key-1", True)]
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["path"])

    async def send(msg):
        seen.append(msg.get("status"))

    mw = APIKeyMiddleware(app, api_key="legacy-key", tenant_keys=tenant_keys_from(env))
    for key in ("acme-key-1", "legacy-key", "wrong"):
        scope = {"type": "http", "path": "/v1/models", "headers": [(b"authorization", f"Bearer {key}".encode())]}
        asyncio.run(mw(scope, None, send))
    assert seen[:2] == ["/v1/models", "/v1/models"] and 401 in seen[2:]
    # Without OSD_API_KEY the ops sessions are signed with the first admin key, never with "".
    assert APIKeyMiddleware(app, api_key="", tenant_keys=tenant_keys_from(env)).key == "beta-key-1"
    assert APIKeyMiddleware(app, api_key="", tenant_keys=[("acme-key-1", False)]).key == ""


def test_the_ops_page_is_never_open_once_any_key_is_set():
    assert KeyRing(_serve(), legacy_key=None).ops_key == "root-key-1"
    assert KeyRing(_serve(), legacy_key="legacy").ops_key == "legacy"
    tenants_only = load_config(environ={}, overrides={"serve": {"api_keys": KEYS[:2]}}).serve
    locked = KeyRing(tenants_only, None).ops_key
    assert locked and locked not in {k["key"] for k in KEYS}
    assert KeyRing(load_config(environ={}).serve, None).ops_key is None


def test_tags_of_evicted_outputs_do_not_pile_up():
    p = SuffixProposer(50, max_depth=4)  # room for about five outputs of ten tokens
    for i in range(500):
        p.remember([1], list(range(10 * i, 10 * i + 9)), pool="acme", tag=Origin("acme", None, f"r{i}", "acme"))
    assert len(p._tags) <= 2 * len(p.pools["acme"].seq_ids()) + 64
    assert p.forget(RecordMatch(request_id="r499").matches_owner) == 1


def test_config_show_hides_keys_and_redis_passwords(capsys, monkeypatch):
    from pipeline.cli import main

    monkeypatch.setenv("OSD_SERVE__API_KEYS", "[{key: acme-key-1, tenant: acme}]")
    monkeypatch.setenv("OSD_STREAM__USERS__PRODUCER__PASSWORD", "hunter2-secret")
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert "acme-key-1" not in out and "hunter2-secret" not in out
    assert "tenant: acme" in out and "password: '***'" in out
