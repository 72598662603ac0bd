"""The ops summary (serve/api/ops/source.py) from a known sequence of records, rollout decisions, replica
samples and trainer status, on a real Redis and a file:// registry; and its pure pieces."""

import time

import numpy as np
import pytest

from infra.common.canary_stats import MIN_GAIN
from infra.records.schema import Record, encode
from infra.registry import Registry
from infra.records.streams import FIELD, connect
from serve.api.ops import stats as st

# Two request shapes whose counts are worked out by hand (k = 4 drafts per step):
# A: steps [acc, acc, rej] [acc, rej]: accepted 3, judged 5, tokens 5, steps 2; at positions [2, 1]
A = ([True, True, False, True, False], [7, 7, 9, 7, 9])
# B: steps [acc x4, bonus] [acc, rej]: accepted 5, judged 6, tokens 7, steps 2; at positions [2, 1, 1, 1]
B = ([True, True, True, True, False, True, False], [7, 7, 7, 7, -1, 7, 9])
# C: steps [rej] [rej]: accepted 0, judged 2, tokens 2, steps 2
C = ([False, False], [9, 9])


def _record(version, shape, created_at):
    acc, drafts = shape
    n = len(acc)
    return Record(request_id=f"r{time.monotonic_ns()}", draft_version=version, prompt_ids=np.arange(3, dtype=np.int32),
                  output_ids=np.full(n, 5, np.int32), topk_ids=np.zeros((n, 2), np.int32),
                  topk_logprobs=np.zeros((n, 2), np.float16), accepted=np.array(acc),
                  draft_tokens=np.array(drafts, np.int32), draft_probs=np.full(n, 0.5, np.float32),
                  created_at=created_at)


@pytest.mark.pure
def test_evidence_counts_steps_and_positions_by_hand():
    a = st.evidence_of(0.0, "v", *A)
    assert (a.sample.accepted, a.sample.judged, a.sample.tokens, a.sample.steps) == (3, 5, 5, 2)
    assert a.accepted_at == (2, 1) and a.drafting_steps == 2
    b = st.evidence_of(0.0, "v", *B)
    assert b.accepted_at == (2, 1, 1, 1) and b.drafting_steps == 2
    assert st.evidence_of(0.0, "none", *A) is None  # autoregressive traffic is not a version
    assert st.evidence_of(0.0, "v", [False, False], [-1, -1]) is None  # nothing drafted


@pytest.mark.pure
def test_percentile_and_weight_steps():
    assert st.percentile([], 50) is None
    assert st.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert st.percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    audit = [{"time": 50.0, "action": "start", "weight": 0.1}, {"time": 150.0, "action": "advance", "weight": 0.5},
             {"time": 180.0, "action": "gated"}, {"time": 190.0, "action": "rollback"}]
    assert st.weight_series(audit, 100.0, 200.0) == [[100.0, 0.1], [150.0, 0.5], [190.0, 0.0], [200.0, 0.0]]
    # A canary set by hand (no audit entry) shows from its alias time; one cleared by hand, at the end.
    assert st.weight_series(audit, 100.0, 200.0, (195.0, 0.3))[-2:] == [[195.0, 0.3], [200.0, 0.3]]
    assert st.weight_series(audit[:2], 100.0, 200.0, (float("inf"), 0.0))[-2:] == [[200.0, 0.0], [200.0, 0.0]]


def _cfg(tmp_path, redis_url):
    from infra.config import load_config

    return load_config(environ={}, overrides={
        "state_dir": str(tmp_path), "stream": {"redis_url": redis_url, "stream": "t:records", "block_ms": 0},
        "rollout": {"canary_steps": [0.1, 0.5, 1.0], "min_requests": 8}})


@pytest.fixture
def loop(tmp_path, redis_url, draft_dir):
    """v1 stable; v2 started at 10% 600 s ago and advanced to 50% 300 s ago; 20 records."""
    cfg = _cfg(tmp_path, redis_url)
    reg = Registry.from_config(cfg)
    now = time.time()
    reg.publish(draft_dir, "v1", metrics={"alpha_est": 0.4})
    reg.promote("v1")
    reg.publish(draft_dir, "v2", lineage={"parent": "v1", "records_consumed": 120}, metrics={"alpha_est": 0.7})
    reg.set_canary("v2", 0.5)
    reg.audit({"action": "start", "version": "v2", "weight": 0.1, "reason": "new candidate", "time": now - 600})
    reg.audit({"action": "advance", "version": "v2", "weight": 0.5, "reason": "not worse", "time": now - 300})
    client = connect(redis_url, cfg.stream)
    # v1: 6 x A and 4 x C, two of the C before the advance (outside the controller's window).
    recs = [_record("v1", A, now - 100) for _ in range(6)] + [_record("v1", C, now - 400) for _ in range(2)]
    recs += [_record("v1", C, now - 100) for _ in range(2)] + [_record("v2", B, now - 100) for _ in range(10)]
    recs.append(_record("none", A, now - 100))  # autoregressive: no row, no evidence
    for r in recs:
        client.xadd(cfg.stream.stream, {FIELD: encode(r)})
    client.xgroup_create(cfg.stream.stream, "trainers", id="0")
    client.xreadgroup("trainers", "t0", {cfg.stream.stream: ">"}, count=4)  # 4 delivered, none acked
    return cfg, reg, client, now


def _replicas(now):
    """Two replicas' stats(recent=True): v1 latencies 1..4 s, one v2 error; drops by reason."""
    def sample(v, lat, tokens=10, decode=0.5, error=None):
        return {"time": now - 50, "version": v, "latency_s": lat, "tokens": tokens, "decode_s": decode,
                "error": error}

    return [{"replica": "a", "records_written": 15, "dropped_by_reason": {"queue_full": 2},
             "recent": [sample("v1", 1.0), sample("v1", 2.0), sample("v2", 1.0), sample("v1", 9.0) | {"time": 0}]},
            {"replica": "b", "records_written": 5, "dropped_by_reason": {"queue_full": 1, "redis_down": 3},
             "recent": [sample("v1", 3.0), sample("v1", 4.0), sample("v2", 0.0, 0, 0.0, "internal")]}]


@pytest.mark.redis
def test_summary_numbers_from_known_records_and_decisions(loop):
    from serve.api.ops.source import OpsSource
    from train.online.metrics import TrainerMetrics

    cfg, reg, client, now = loop
    tm = TrainerMetrics(0, client, cfg.stream.stream)
    tm.step(1.5, 100)
    tm.checkpoint("step-2", {"version": "v2", "alpha_est": 0.7, "loss": 1.5, "records_consumed": 100})
    s = OpsSource(cfg, client=client).summary(_replicas(now), now=now)

    h = s["header"]
    assert (h["stable"], h["canary"], h["canary_weight"], h["canary_step"]) == ("v1", "v2", 0.5, 2)
    assert h["last_decision"]["action"] == "advance" and h["last_decision"]["reason"] == "not worse"
    rows = {r["version"]: r for r in s["versions"]}
    assert [r["version"] for r in s["versions"]] == ["v1", "v2"]  # stable first, no "none"
    v1, v2 = rows["v1"], rows["v2"]
    assert (v1["role"], v1["records"], v1["draft_tokens"]) == ("stable", 10, 38)
    assert v1["acceptance"] == pytest.approx(18 / 38) and v1["mean_accepted_len"] == pytest.approx(38 / 20)
    lo, hi = v1["acceptance_ci"]
    assert lo < 18 / 38 < hi
    assert v2["acceptance"] == pytest.approx(50 / 60) and v2["mean_accepted_len"] == pytest.approx(3.5)
    assert v2["acceptance_ci"] is None or v2["acceptance_ci"][0] <= 50 / 60  # identical requests: no spread
    # Serving samples: the one older than the window is left out.
    assert (v1["requests"], v1["errors"], v1["latency_p50_s"]) == (4, 0, 2.5)
    assert v1["latency_p95_s"] == pytest.approx(3.85) and v1["output_tokens_per_s"] == pytest.approx(20.0)
    assert (v2["requests"], v2["errors"], v2["error_rate"]) == (2, 1, 0.5)

    assert s["charts"]["per_position"]["v1"] == pytest.approx([12 / 20, 6 / 20])
    assert s["charts"]["per_position"]["v2"] == pytest.approx([1.0, 0.5, 0.5, 0.5])
    assert [m["action"] for m in s["charts"]["markers"]] == ["start", "advance"]
    assert s["charts"]["from"] == pytest.approx(now - 600)  # the window's first data: the start
    assert [w for _, w in s["charts"]["canary_weight"]] == [0.1, 0.5, 0.5]
    series = s["charts"]["acceptance"]["v2"]
    assert [round(v, 4) for _, v in series if v is not None] == [round(50 / 60, 4)]

    c = s["comparison"]  # the controller's window: since the advance, so the two early C are out
    assert c["since"] == pytest.approx(now - 300) and c["requests"] == {"stable": 8, "canary": 10}
    assert c["acceptance"]["diff"] == pytest.approx(50 / 60 - 18 / 34)
    # 50% is the last step before full traffic: the promote check shows beside the rollback ones.
    assert [k["check"] for k in c["checks"]] == ["not worse (no rollback)"] * 2 + ["better (promote)"]
    assert c["checks"][2]["threshold"] == MIN_GAIN
    assert c["checks"][0]["threshold"] == -cfg.rollout.margin
    assert c["checks"][0]["verdict"] == ("pass" if c["checks"][0]["lower"] > -cfg.rollout.margin else "pending")

    lp = s["loop"]
    assert lp["records_written"] == 20 and lp["records_dropped"] == {"queue_full": 3, "redis_down": 3}
    assert lp["stream"]["length"] == 21
    g = {x["group"]: x for x in lp["stream"]["groups"]}["trainers"]
    assert (g["lag"], g["pending"], g["consumers"]) == (17, 4, 1)
    (t,) = lp["trainers"]
    assert (t["step"], t["loss"], t["records"], t["exports"], t["last_checkpoint"]) == (1, 1.5, 100, 1, "step-2")
    assert lp["last_candidate"] == {"version": "v2", "alpha_est": 0.7, "created_at": pytest.approx(time.time(), abs=60)}
    regv = {v["version"]: v for v in s["registry"]["versions"]}
    assert (regv["v2"]["parent"], regv["v2"]["records_consumed"], regv["v2"]["alpha_est"]) == ("v1", 120, 0.7)
    assert [e["action"] for e in s["registry"]["alias_history"]] == ["advance", "start"]


@pytest.mark.redis
def test_no_promote_check_before_the_last_step_and_page_renders(loop):
    from serve.api.ops import page as ops_page
    from serve.api.ops.source import OpsSource

    cfg, reg, client, now = loop
    reg.set_canary("v2", 0.1)  # 0.1 -> next is 0.5: widening needs only "not worse"
    s = OpsSource(cfg, client=client).summary([], now=now)
    assert [k["metric"] for k in s["comparison"]["checks"]] == ["acceptance", "mean_accepted_len"]
    assert s["header"]["canary_step"] == 1
    reg.clear_canary()
    s2 = OpsSource(cfg, client=client).summary([], now=now)
    assert s2["comparison"] is None and s2["header"]["canary"] is None
    html = ops_page.page(s, live=False)
    assert html.count("class='version-row") == 2 and html.count("<svg") == 4 and "<script" not in html
    assert "<script" in ops_page.page(s)  # the live page refreshes itself


def test_batch_size_over_time_comes_from_the_replicas_step_logs(loop):
    from serve.api.ops import page as ops_page
    from serve.api.ops.source import OpsSource

    cfg, reg, client, now = loop
    replicas = [{"replica": "r1", "batch_series": [[now - 7200, 9.0, 9.0, 3], [now - 20, 3.0, 7.5, 40]]},
                {"replica": "r2", "batch_series": []}]
    s = OpsSource(cfg, client=client).summary(replicas, now=now)
    assert s["charts"]["batch_size"] == {"replica r1": [[now - 20, 3.0]]}  # the window's only
    assert "Batch size over time" in ops_page.page(s, live=False)


@pytest.mark.redis
def test_a_redis_outage_shows_on_the_page_instead_of_failing_it(loop):
    from serve.api.ops import page as ops_page
    from serve.api.ops.source import OpsSource

    cfg, reg, client, now = loop
    dead = connect("redis://127.0.0.1:1", cfg.stream)  # nothing listens on port 1
    s = OpsSource(cfg, client=dead).summary([], now=now)
    assert s["problems"] and s["problems"][0].startswith("Redis:")
    assert s["header"]["stable"] == "v1" and s["loop"]["stream"]["length"] is None
    assert [(r["version"], r["records"]) for r in s["versions"]] == [("v1", 0), ("v2", 0)]  # roles, no data
    assert "Redis:" in ops_page.page(s)


@pytest.mark.redis
def test_demo_report_links_a_static_snapshot(loop, tmp_path):
    from pipeline.traffic.demo import save_ops_snapshot
    from serve.api.ops.source import OpsSource

    cfg, reg, client, now = loop
    out = save_ops_snapshot(OpsSource(cfg, client=client).summary([], now=now), "http://127.0.0.1:8000", tmp_path)
    assert out == {"page": "http://127.0.0.1:8000/ops", "snapshot": "ops.html"}
    html = (tmp_path / "ops.html").read_text()
    assert "data-version='v2'" in html and "<script" not in html and "snapshot" in html
    assert save_ops_snapshot(None, "http://x", tmp_path / "none") == {"page": "http://x/ops", "snapshot": None}


@pytest.mark.pure
def test_session_tokens_expire_and_bind_to_the_key_and_to_ops_paths():
    from serve.api.ops import auth as oa

    tok = oa.session_token("k", now=1000.0)
    assert oa.valid_token("k", tok, now=1000.0 + oa.TTL_S - 1)
    assert not oa.valid_token("k", tok, now=1000.0 + oa.TTL_S + 1)  # expired
    assert not oa.valid_token("other", tok, now=1000.0)  # a new key ends every session
    expiry, mac = tok.split(".")
    assert not oa.valid_token("k", f"{int(expiry) + 99}.{mac}", now=1000.0)  # expiry is signed
    cookie = f"a=b; {oa.COOKIE}={oa.session_token('k')}"
    assert oa.session_ok("k", "/ops/api/summary", cookie) and oa.session_ok("k", "/ops", cookie.encode())
    assert not oa.session_ok("k", "/v1/models", cookie) and not oa.session_ok("k", "/opsx", cookie)
    assert "HttpOnly" in oa.set_cookie(tok, False) and "Secure" in oa.set_cookie(tok, True)


@pytest.mark.pure
def test_proxy_lets_a_session_cookie_through_on_ops_paths_only():
    import asyncio

    from serve.api.ops import auth as oa
    from serve.api.proxy_auth import APIKeyMiddleware

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    def status(path, headers=()):
        sent = []

        async def send(msg):
            sent.append(msg)

        scope = {"type": "http", "path": path, "headers": list(headers)}
        asyncio.run(APIKeyMiddleware(app, api_key="k")(scope, None, send))
        return sent[0]["status"]

    cookie = (b"cookie", f"{oa.COOKIE}={oa.session_token('k')}".encode())
    assert status("/ops") == 200 and status("/ops/login") == 200  # the ingress redirects / shows the form
    assert status("/ops/api/summary") == 401 and status("/ops/fragment") == 401
    assert status("/ops/api/summary", [cookie]) == 200 and status("/ops/fragment", [cookie]) == 200
    assert status("/v1/models", [cookie]) == 401 and status("/-/routes", [cookie]) == 401
    assert status("/v1/models", [(b"authorization", b"Bearer k")]) == 200


def test_the_suffix_index_shows_when_a_replica_serves_one(loop):
    from serve.api.ops import page as ops_page
    from serve.api.ops.source import OpsSource

    cfg, reg, client, now = loop
    plain = OpsSource(cfg, client=client).summary([{"replica": "r0"}], now=now)
    assert plain["loop"]["suffix"] == [] and "Suffix index" not in ops_page.page(plain, live=False)
    replicas = [{"replica": "r1", "suffix": {"global_tokens": 1000, "global_bytes": 2**20, "proposal_rate": 0.5}},
                {"replica": "r2", "suffix": {"global_tokens": 500, "global_bytes": 2**20, "proposal_rate": 0.25}}]
    s = OpsSource(cfg, client=client).summary(replicas, now=now)
    assert s["loop"]["suffix"] == {"tokens": 1500, "bytes": 2**21, "proposal_rate": 0.375}
    assert "Suffix index 1500 tokens (2.0 MiB) &middot; a chain on 38% of lookups" in ops_page.page(s, live=False)


def test_drafting_steps_by_source_sum_over_replicas_and_show(loop):
    """Per version and source (a hybrid's head or suffix steps): acceptance and tokens a
    drafting step emitted, summed over the replicas, in the summary and on the page."""
    from serve.api.ops import page as ops_page
    from serve.api.ops.source import OpsSource

    cfg, reg, client, now = loop
    row = {"draft_version": "v1", "source": "suffix", "steps": 10, "drafted": 30, "accepted": 15}
    replicas = [{"replica": "r1", "by_source": [row, {**row, "source": "head", "accepted": 6}]},
                {"replica": "r2", "by_source": [row]}, {"replica": "r3"}]
    s = OpsSource(cfg, client=client).summary(replicas, now=now)
    got = {r["source"]: r for r in s["loop"]["by_source"]}
    assert got["suffix"]["steps"] == 20 and got["suffix"]["acceptance"] == 0.5
    assert got["suffix"]["tokens_per_step"] == (30 + 20) / 20
    assert got["head"]["acceptance"] == 0.2 and got["head"]["tokens_per_step"] == 1.6
    html = ops_page.page(s, live=False)
    assert "ops-sources" in html and "<td>0.500</td><td>2.50</td>" in html
    plain = OpsSource(cfg, client=client).summary([{"replica": "r0"}], now=now)
    assert plain["loop"]["by_source"] == [] and "ops-sources" not in ops_page.page(plain, live=False)
