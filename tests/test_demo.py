"""The demo's paired estimate: every version scored on the same held-out post-shift code records."""

import dataclasses

import numpy as np
import pytest
import torch

from infra.config import OSDConfig
from infra.records.schema import Record
from infra.registry import Registry
from train.online.trainer import is_held_out

pure = pytest.mark.pure  # all but the stream test, which reads a real Redis


def records_from(draft, n: int, *, domain: str, created_at: float, k: int = 16) -> list[Record]:
    """Records whose target top-k is exactly `draft`'s distribution: `draft` is the perfect draft for them."""
    from train.distill.batching import pack, position_logits

    rng = np.random.default_rng(int(created_at) + n)
    out = []
    for i in range(n):
        prompt = rng.integers(1, 200, 6).astype(np.int32)
        output = rng.integers(1, 200, 10).astype(np.int32)
        # A fixed record id (the default is a random uuid): which records are held out is
        # decided by a hash of the id, and 12 random ids hold none out in 0.8% of runs.
        stub = Record(record_id=f"{domain}-{created_at}-{i}", request_id=f"{domain}-{created_at}-{i}",
                      draft_version="v1", prompt_ids=prompt,
                      output_ids=output, topk_ids=np.zeros((10, k), np.int32),
                      topk_logprobs=np.zeros((10, k), np.float16), accepted=np.zeros(10, bool),
                      draft_tokens=np.full(10, -1, np.int32), draft_probs=np.full(10, np.nan, np.float32),
                      domain=domain, created_at=created_at)
        with torch.no_grad():
            lp = torch.log_softmax(position_logits(draft, pack([stub], 64)), -1)
        top = lp.topk(k, -1)
        stub.topk_ids = top.indices.numpy().astype(np.int32)
        stub.topk_logprobs = top.values.numpy().astype(np.float16)
        out.append(stub)
    return out


@pure
def test_every_version_is_scored_on_the_same_held_out_post_shift_code_records(tiny, tmp_path, one_thread):
    from pipeline.traffic.demo import paired_alpha
    from infra.drafts.layer import DraftSpec, build_draft, save_draft

    torch.manual_seed(0)
    cfg = OSDConfig.model_validate({"train": {"held_out_every": 3}})
    spec = DraftSpec(num_layers=1)
    good = build_draft(tiny.model, spec)
    other = build_draft(tiny.model, spec)
    with torch.no_grad():  # a different draft: the same shape, other weights
        for p in other.model.layers.parameters():
            p.add_(torch.randn_like(p))
    reg = Registry((tmp_path / "reg").as_uri(), cache_dir=tmp_path / "cache")
    for name, d in (("v1", other), ("v2", good)):
        save_draft(d, spec, tmp_path / name, target_ref={"spec": "tiny-random"}, lineage={"parent": None})
        reg.publish(tmp_path / name, name)

    shift = 1000.0
    recs = (records_from(good, 12, domain="code", created_at=shift + 5)
            + records_from(good, 6, domain="code", created_at=shift - 5)  # before the shift
            + records_from(good, 6, domain="general", created_at=shift + 5))  # not code
    want = [r for r in recs if r.created_at >= shift and r.domain == "code" and is_held_out(r.record_id, 3)]
    assert 0 < len(want) < 12  # some post-shift code records were trained on, so they are left out
    # A held-out record of a prompt the trainer also took (a repeat) is not unseen: left out too.
    trained = next(r for r in recs if not is_held_out(r.record_id, 3))
    repeat = dataclasses.replace(want[0], prompt_ids=trained.prompt_ids.copy(),
                                 record_id=next(f"repeat-{i}" for i in range(100) if is_held_out(f"repeat-{i}", 3)))
    recs.append(repeat)

    out = paired_alpha(cfg, recs, shift, tiny.model, reg)
    assert out["records"] == len(want) and out["positions"] == 10 * len(want)
    assert [v["version"] for v in out["versions"]] == ["v1", "v2"]
    a = {v["version"]: v["alpha_est"] for v in out["versions"]}
    # v2 is the distribution the records hold: it matches all the mass of their top-k.
    assert a["v2"] > 0.85 and a["v1"] < a["v2"] - 0.1
    # Capped: evenly spaced over the phase, the same records for every version.
    capped = paired_alpha(cfg, recs, shift, tiny.model, reg, max_records=2)
    assert capped["records"] == 2 and capped["positions"] == 20 and len(capped["versions"]) == 2


@pure
def test_a_head_version_is_scored_by_its_own_family_beside_a_layer_version(tiny, tmp_path, one_thread):
    """`osd demo --family head`: v1 is a head, later versions may be heads; each is scored as the
    gate scores it (a head on the target's features), on the same positions as a layer version."""
    from pipeline.traffic.demo import paired_alpha
    from infra.drafts.head import build_head, save_head
    from infra.drafts.layer import DraftSpec, build_draft, save_draft
    from train.distill.head import per_record_acceptance_head, per_record_scores_head

    torch.manual_seed(0)
    cfg = OSDConfig.model_validate({"train": {"held_out_every": 2}})
    layer = build_draft(tiny.model, DraftSpec(num_layers=1))
    head = build_head(tiny.model, DraftSpec(family="head", feature_layers=(0, 1), draft_vocab=128))
    reg = Registry((tmp_path / "reg").as_uri(), cache_dir=tmp_path / "cache")
    save_head(head, tmp_path / "h", target_ref={"spec": "tiny-random"}, lineage={"parent": None})
    save_draft(layer, DraftSpec(num_layers=1), tmp_path / "l", target_ref={"spec": "tiny-random"},
               lineage={"parent": "h1"})
    reg.publish(tmp_path / "h", "h1")
    reg.publish(tmp_path / "l", "l2")

    recs = records_from(layer, 8, domain="code", created_at=10.0)
    held = [r for r in recs if is_held_out(r.record_id, 2)]
    out = paired_alpha(cfg, recs, 0.0, tiny.model, reg)
    got = {v["version"]: v for v in out["versions"]}
    assert got["h1"]["family"] == "head" and got["l2"]["family"] == "layer"
    scores = per_record_acceptance_head(head, tiny.model, held, cfg.train.max_seq_len)
    assert sum(p for _, p in scores) == out["positions"]  # the same positions as the layer version
    assert got["h1"]["alpha_est"] == pytest.approx(sum(a for a, _ in scores) / out["positions"], rel=1e-5)
    # The records are the layer draft's own distribution: it matches their top-k, the head does not.
    assert got["l2"]["alpha_est"] > 0.85 > got["h1"]["alpha_est"]
    # A head's greedy agreement beside its bound, from the same unroll; a layer version has none.
    greedy = per_record_scores_head(head, tiny.model, held, cfg.train.max_seq_len)
    assert got["h1"]["greedy_est"] == pytest.approx(sum(g for _, g, _ in greedy) / out["positions"], rel=1e-5)
    assert got["h1"]["greedy_est"] != pytest.approx(got["h1"]["alpha_est"]) and got["l2"]["greedy_est"] is None


@pure
def test_the_demo_names_an_unknown_draft_family():
    from infra.drafts.spec import warm_start_path

    cfg = OSDConfig.model_validate({"state_dir": "/x"})
    assert str(warm_start_path(cfg, "layer")) == "/x/drafts/v1"
    assert str(warm_start_path(cfg, "head")) == "/x/drafts/head-v1"
    with pytest.raises(ValueError, match="unknown draft family 'eagle'; known: layer, head"):
        warm_start_path(cfg, "eagle")


@pure
def test_the_demo_builds_a_missing_head_once_with_the_configured_settings(tmp_path, monkeypatch):
    import train.warm.head as hws
    from pipeline.traffic.demo import prepare

    calls = []

    def fake(cfg, **kw):  # the real warm start takes ~25 minutes: only its arguments are checked
        teacher = kw.pop("generate")
        calls.append((kw.pop("conversations", 0), cfg.train.head_warm_epochs, teacher.tag, kw))
        (tmp_path / "drafts" / "head-v1").mkdir(parents=True)

    monkeypatch.setattr(hws, "run_head_warm_start", fake)
    cfg = OSDConfig.model_validate({"state_dir": str(tmp_path), "model": {"target": "tiny-random"}})
    for _ in range(2):
        _, v1 = prepare(cfg)
    assert v1 == tmp_path / "drafts" / "head-v1"
    # The measured defaults and the serving engine as teacher, built once, then taken from disk.
    assert calls == [(0, 2, "engine-none", {})]


@pure
def test_no_held_out_post_shift_records_means_no_scores(tiny, tmp_path):
    from pipeline.traffic.demo import paired_alpha

    reg = Registry((tmp_path / "reg").as_uri(), cache_dir=tmp_path / "cache")
    out = paired_alpha(OSDConfig(), [], 0.0, tiny.model, reg)
    assert out == {"records": 0, "positions": 0, "versions": []}


@pure
def test_a_corrupt_version_is_named_and_the_others_still_scored(tiny, tmp_path, capsys):
    from pipeline.traffic.demo import paired_alpha
    from infra.drafts.layer import WEIGHTS_FILE, DraftSpec, build_draft, save_draft

    cfg = OSDConfig.model_validate({"train": {"held_out_every": 2}})
    spec = DraftSpec(num_layers=1)
    draft = build_draft(tiny.model, spec)
    reg = Registry((tmp_path / "reg").as_uri(), cache_dir=tmp_path / "cache")
    for name in ("v1", "v2"):
        save_draft(draft, spec, tmp_path / name, target_ref={"spec": "tiny-random"}, lineage={"parent": None})
        reg.publish(tmp_path / name, name)
    weights = reg.payload_dir(reg.get("v1")) / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:100])  # truncated after publishing

    recs = records_from(draft, 8, domain="code", created_at=10.0)
    out = paired_alpha(cfg, recs, 0.0, tiny.model, reg)
    assert out["records"] == sum(is_held_out(r.record_id, 2) for r in recs) > 0
    assert [v["version"] for v in out["versions"]] == ["v2"]
    assert "paired estimate: cannot load v1 (DigestMismatch" in capsys.readouterr().out


@pure
def test_a_dead_redis_costs_the_paired_estimate_only(capsys):
    from pipeline.traffic.demo import stream_records
    from infra.redis.server import free_port

    cfg = OSDConfig.model_validate({"stream": {"redis_url": f"redis://127.0.0.1:{free_port()}/0",
                                               "connect_timeout_s": 0.2, "socket_timeout_s": 0.5,
                                               "block_ms": 100}})
    assert stream_records(cfg) == []
    assert "paired estimate skipped: cannot read the record stream" in capsys.readouterr().out


@pytest.mark.redis
def test_stream_records_come_from_the_stream(redis_url):
    import redis

    from pipeline.traffic.demo import stream_records
    from infra.records.schema import encode
    from infra.records.streams import FIELD

    cfg = OSDConfig.model_validate({"stream": {"redis_url": redis_url}})
    rec = Record(request_id="r", draft_version="v1", prompt_ids=np.arange(3, dtype=np.int32),
                 output_ids=np.arange(2, dtype=np.int32), topk_ids=np.zeros((2, 2), np.int32),
                 topk_logprobs=np.zeros((2, 2), np.float16), accepted=np.zeros(2, bool),
                 draft_tokens=np.full(2, -1, np.int32), draft_probs=np.full(2, np.nan, np.float32))
    redis.Redis.from_url(redis_url).xadd(cfg.stream.stream, {FIELD: encode(rec)})
    assert [r.record_id for r in stream_records(cfg)] == [rec.record_id]


@pure
def test_speed_prompts_file_reads_back_for_osd_bench_engine(tmp_path):
    from pipeline.traffic.demo import write_prompts
    from infra.prompts import Prompt, load_jsonl

    prompts = [Prompt("sg-1", 'print("a")\n\tdef f(): pass', "code", "held_out"),
               Prompt("sg-2", "Write me a haiku", "writing", "held_out")]
    path = tmp_path / "demo" / "speed_prompts.jsonl"
    write_prompts(prompts, path)
    back = load_jsonl(path)
    assert [(p.id, p.domain, p.text) for p in back] == [(p.id, p.domain, p.text) for p in prompts]


@pure
def test_report_counts_requests_decisions_and_names_each_version_s_paired_estimate():
    from pipeline.traffic.demo import PhaseRun, build_report

    decisions = [{"time": 5.0, "action": "start", "version": "v2", "reason": "new", "weight": 0.5},
                 {"time": 6.0, "action": "promote", "version": "v2", "reason": "ok", "evidence": {}},
                 {"time": 7.0, "action": "rollback", "version": "v3", "reason": "worse", "weight": 0.5}]
    run = PhaseRun(t0=1.0, shift=4.0, speed={"speedup_vs_ar": 1.5, "pairs": []},
                   controller={"decisions": decisions, "aliases": {"stable": {"version": "v2"}}},
                   samples=[], records=[])
    results = [{"ok": True, "phase": "general"}, {"ok": False, "phase": "code", "error": "timeout"},
               {"ok": True, "phase": "code"}]
    versions = [{"version": "v1"}, {"version": "v2"}]
    paired = {"records": 3, "positions": 30, "versions": [{"version": "v2", "alpha_est": 0.7}]}
    r = build_report(run, results, versions, paired, general_s=10, code_s=20)
    assert (r["requests"], r["failed_requests"], r["errors"]) == (3, 1, ["timeout"])
    assert r["promoted"] == ["v2"] and r["rolled_back"] == ["v3"] and r["speedup_vs_ar"] == 1.5
    assert [v.get("alpha_est_post_shift") for v in r["versions"]] == [None, 0.7]
    assert r["phases"] == {"general_s": 10, "code_s": 20, "shift_time": 4.0, "start_time": 1.0,
                           "requests_general": 1, "requests_code": 2}
    assert r["decisions"][1] == {"time": 6.0, "action": "promote", "version": "v2", "reason": "ok", "weight": None}


def test_the_code_phase_sends_no_prompt_the_head_answered_in_its_warm_start():
    from pipeline.traffic.demo import workload_prompts
    from train.teacher.sets import warm_prompts

    cfg = OSDConfig()
    wcfg = cfg.for_warm_start("head")
    warm_code = {p.text for p in warm_prompts(wcfg, wcfg.train.warm_prompts) if p.domain == "code"}
    assert len(warm_code) > 20  # every human turn of v1's 1536 prompts: code among them, so this can fail
    general, code, speed = workload_prompts(cfg, 12, "head")
    assert code and not warm_code & {p.text for p in code + speed + general}
