"""Online training of a head draft (train/online/family.py's HeadFamily in the trainer actors).

The pieces (batch from records, null batch, per-record acceptance, the α it raises) on tiny
random Llamas with no services; then a TrainerGroup on a real local Ray and redis-server that
starts from a saved head, trains on streamed records and publishes head versions.
"""

import json

import numpy as np
import pytest
import torch

from infra.drafts.head import build_head, save_head
from infra.drafts.spec import DraftSpec
from infra.records.schema import Record
from infra.target import build_tiny_llama
from test_draft_head import _TorchEngine  # DistillEngine's contract over AdamW
from test_trainer import group_state, produce, ray_local, records, stream  # noqa: F401 (fixtures)

LAYERS = (0, 1, 2)


def tiny(seed=7, layers=4):
    m = build_tiny_llama(seed=seed, num_layers=layers, max_positions=128)
    m.config.eos_token_id = m.generation_config.eos_token_id = None
    return m


def train_cfg(**kw):
    from infra.config import load_config

    return load_config(environ={}, overrides={"train": kw}).train


def greedy_records(target, n, prompt_len=6, new=24, k=8, seed=0):
    """The target's greedy continuations of random prompts, with its top-k per output position."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(0, 259, (prompt_len,), generator=g)
        with torch.no_grad():
            seq = target.generate(p.view(1, -1), do_sample=False, max_new_tokens=new)[0]
            lp = torch.log_softmax(target(seq.view(1, -1)).logits[0, prompt_len - 1:-1].float(), -1)
        top = lp.topk(k, dim=-1)
        out.append(Record(request_id=f"r{seed}-{i}", draft_version="x", prompt_ids=p.numpy().astype(np.int32),
                          output_ids=seq[prompt_len:].numpy().astype(np.int32),
                          topk_ids=top.indices.numpy().astype(np.int32),
                          topk_logprobs=top.values.numpy().astype(np.float16), accepted=np.zeros(new, bool),
                          draft_tokens=np.full(new, -1, np.int32), draft_probs=np.zeros(new, np.float32)))
    return out


@pytest.fixture(scope="module")
def target():
    return tiny()


@pytest.fixture(scope="module")
def recs(target):
    return greedy_records(target, 24)


def fresh_head(target, vocab=None):
    d2t = None if vocab is None else torch.randperm(259, generator=torch.Generator().manual_seed(1))[:vocab]
    return build_head(target, DraftSpec(family="head", feature_layers=LAYERS, draft_vocab=259), d2t)


@pytest.mark.pure
@pytest.mark.usefixtures("one_thread")
def test_head_batch_from_records_has_the_features_compute_features_gives(target, recs):
    from train.distill.batching import pack
    from train.online.family import HeadFamily
    from train.distill.head import collate, compute_features

    max_seq_len = 20  # cuts the 30-token records: the head sees the tokens a layer draft would
    fam = HeadFamily(target, train_cfg(max_seq_len=max_seq_len), fresh_head(target, 150))
    b = fam.batch(recs[:5])
    packed = pack(recs[:5], max_seq_len)
    seqs = [packed.input_ids[i][packed.attention_mask[i].bool()].tolist() for i in range(5)]
    assert all(len(s) == max_seq_len for s in seqs)
    ref = collate(compute_features(target, seqs, LAYERS, starts=[1] * 5), range(5))  # 19 outputs: 1 prompt token
    assert b.feats.shape == ref.feats.shape == (5, max_seq_len - 1, len(LAYERS) * 64)
    for name in ("feats", "next_ids", "final", "target_argmax", "valid", "start"):
        assert torch.equal(getattr(b, name), getattr(ref, name)), name
    assert b.n_records == 5 and b.n_tokens == 5 * (max_seq_len - 1)
    # The features are the target's own layer outputs at those tokens.
    with torch.no_grad():
        hs = target(torch.tensor([seqs[2]]), output_hidden_states=True).hidden_states
    direct = torch.cat([hs[i + 1][0] for i in LAYERS], -1)[:-1]
    assert torch.allclose(b.feats[2], direct, atol=0.05, rtol=0.02)  # bf16 storage


@pytest.mark.pure
@pytest.mark.usefixtures("one_thread")
def test_null_head_batch_gives_zero_loss_and_zero_gradients_connected_to_the_graph(target):
    from train.online.family import HeadFamily

    head = fresh_head(target, 150)
    fam = HeadFamily(target, train_cfg(), head)
    loss = fam.loss_fn()(head, fam.null_batch())
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    grads = [p.grad for p in head.parameters()]
    assert all(g is not None and not g.abs().any() for g in grads)


@pytest.mark.pure
@pytest.mark.usefixtures("one_thread")
def test_per_record_acceptance_of_a_head_matches_a_direct_computation(target, recs):
    """Depth 1: the head's draft at row p+k-2 (features of position p+k-2, token p+k-1) for
    output k, as full-vocab logits (-inf outside d2t), through the layer family's measure."""
    from train.distill.head import compute_features, per_record_acceptance_head
    from train.distill.losses import expected_acceptance

    head = fresh_head(target, 150)
    got = per_record_acceptance_head(head, target, recs[:4], 1024, depth=1)
    for rec, (s, n) in zip(recs[:4], got):
        seq = rec.prompt_ids.tolist() + rec.output_ids.tolist()
        fs = compute_features(target, [seq], LAYERS)
        with torch.no_grad():
            z = head.unroll(fs.feats[0][None, :-1].float(), fs.ids[0][None, 1:], 1)[0][0]
        p = len(rec.prompt_ids)
        full = torch.full((len(rec.output_ids), 259), float("-inf"))
        full[:, head.d2t] = z[p - 2: p - 2 + len(rec.output_ids)]
        lower = expected_acceptance(full, torch.as_tensor(rec.topk_ids).long(),
                                    torch.as_tensor(rec.topk_logprobs).float()).lower
        assert n == len(rec.output_ids) and s == pytest.approx(float(lower.sum()), abs=1e-4)


@pytest.mark.pure
@pytest.mark.usefixtures("one_thread")
def test_greedy_agreement_of_a_head_matches_a_direct_computation(target, recs):
    """per_record_scores_head's greedy agreement: per output, whether the head's greedy token at
    depth 1 is the record's top-1 (the target's greedy token); a head whose vocabulary lacks that
    token never agrees there. Its bound is per_record_acceptance_head's."""
    from train.distill.head import compute_features, per_record_acceptance_head, per_record_scores_head

    head = fresh_head(target, 150)
    both = per_record_scores_head(head, target, recs[:4], 1024, depth=1)
    got = [(g, n) for _, g, n in both]
    agreed = 0
    for rec, (s, n) in zip(recs[:4], got):
        seq = rec.prompt_ids.tolist() + rec.output_ids.tolist()
        fs = compute_features(target, [seq], LAYERS)
        with torch.no_grad():
            z = head.unroll(fs.feats[0][None, :-1].float(), fs.ids[0][None, 1:], 1)[0][0]
        p = len(rec.prompt_ids)
        mine = head.d2t[z[p - 2: p - 2 + len(rec.output_ids)].argmax(-1)]
        want = (mine == torch.as_tensor(rec.topk_ids[:, 0]).long()).sum()
        assert n == len(rec.output_ids) and s == float(want)
        agreed += int(want)
    assert agreed > 0  # the check saw agreements, not only zeros
    bound = per_record_acceptance_head(head, target, recs[:4], 1024, depth=1)
    assert [s for s, _ in bound] != [s for s, _ in got] and bound == [(b, n) for b, _, n in both]


@pytest.mark.pure
@pytest.mark.usefixtures("one_thread")
def test_the_family_steps_on_the_configured_head_loss(target, recs):
    """train.head_loss picks head_loss_fn's terms: the soft cross-entropy and total variation
    summed by default, either alone by name; an unknown name is refused by the config."""
    from train.distill.head import HEAD_LOSSES, head_loss_fn
    from train.online.family import HeadFamily

    head = fresh_head(target, 150)
    assert train_cfg().head_loss == "ce+tv"
    got = {}
    for name, terms in HEAD_LOSSES.items():
        fam = HeadFamily(target, train_cfg(head_loss=name), head)
        batch = fam.batch(recs[:3])
        got[name] = float(fam.loss_fn()(head, batch))
        want = head_loss_fn(target.lm_head.weight.detach(), rows="outputs", **terms)(head, batch)
        assert got[name] == pytest.approx(float(want), rel=1e-6)
    assert 0 < got["tv"] < 1 + 0.8 + 0.8 ** 2 and got["ce+tv"] == pytest.approx(got["ce"] + got["tv"], rel=1e-5)
    with pytest.raises(Exception, match="head_loss"):
        train_cfg(head_loss="kl")


@pytest.mark.pure
@pytest.mark.usefixtures("one_thread")
def test_the_family_scores_greedy_agreement_of_its_own_heads_only(target, recs):
    from train.online.family import HeadFamily

    head = fresh_head(target, 150)
    fam = HeadFamily(target, train_cfg(), head)
    greedy = [(g, n) for _, g, n in fam.scores(head, recs[:3])]
    assert all(0 <= s <= n for s, n in greedy) and greedy != fam.score(head, recs[:3])
    other = build_head(target, DraftSpec(family="head", feature_layers=(0,), draft_vocab=259), None)
    with pytest.raises(ValueError, match="greedy agreement is measured for a head on this family's"):
        fam.scores(other, recs[:3])


@pytest.mark.pure
@pytest.mark.usefixtures("one_thread")
def test_scores_on_the_counted_rows_alone_equal_those_of_the_full_unroll(target):
    """evaluate and per_record_acceptance_head unroll prompt rows as depth-1 keys only and take the
    LM head on the rows they count: the same figures as the full unroll's logits everywhere, on
    a batch whose records start at different rows (prompts of 3, 6 and 11 tokens)."""
    from train.distill.head import DEPTH, collate, compute_features, evaluate, per_record_acceptance_head
    from train.distill.losses import expected_acceptance

    head = fresh_head(target, 150)
    recs = [r for n, p in ((2, 3), (2, 6), (2, 11)) for r in greedy_records(target, n, prompt_len=p, new=12, seed=p)]
    fs = compute_features(target, [r.prompt_ids.tolist() + r.output_ids.tolist() for r in recs], LAYERS,
                          starts=[len(r.prompt_ids) for r in recs])
    b = collate(fs, range(len(recs)))
    with torch.no_grad():
        full = head.unroll(b.feats, b.next_ids, DEPTH)
    t = torch.arange(b.valid.shape[1]).view(1, -1)
    agree = [float(((head.d2t[z.argmax(-1)] == b.target_argmax) & m).sum() / m.sum())
             for j, z in enumerate(full, start=1) for m in [b.valid & (t >= b.start.view(-1, 1) + j - 1)]]
    ev = evaluate(head, fs)
    assert ev["agree_per_depth"] == pytest.approx(agree, abs=1e-6)
    counted = b.valid & (t >= b.start.view(-1, 1))  # coverage counts the rows from each start, as before
    assert ev["coverage"] == pytest.approx(float(head.t2d()[b.target_argmax.clamp(min=0)][counted].float().mean()))
    assert ev["rows"] == int(counted.sum())

    got = per_record_acceptance_head(head, target, recs, 1024, features=fs)
    for i, (rec, (s, n)) in enumerate(zip(recs, got)):
        p, k = len(rec.prompt_ids), len(rec.output_ids)
        ids, lp = torch.as_tensor(rec.topk_ids).long(), torch.as_tensor(rec.topk_logprobs).float()
        total, depths = torch.zeros(k, dtype=torch.float64), torch.zeros(k)
        for j, z in enumerate(full, start=1):
            rows = torch.arange(k) + p - 2
            ok = rows >= j - 1
            v = torch.full((int(ok.sum()), 259), float("-inf"))
            v[:, head.d2t] = z[i, rows[ok]]
            total[ok] += expected_acceptance(v, ids[ok], lp[ok]).lower.double()
            depths[ok] += 1
        assert n == k and s == pytest.approx(float((total / depths).sum()), abs=1e-4)


@pytest.mark.pure
@pytest.mark.usefixtures("one_thread")
def test_heads_scored_with_a_feature_cache_share_one_target_forward_and_score_the_same(target, recs, monkeypatch):
    """The demo's paired estimate scores every version on the same records: the target's
    features are computed once per set of feature layers, and the scores are unchanged."""
    import train.distill.head as ht
    from train.online.family import per_record

    heads = [fresh_head(target, 150), fresh_head(target, 200)]
    with torch.no_grad():
        heads[1].fc.weight.mul_(0.5)  # another head on the same feature layers
    alone = [per_record(h, target, recs[:6], 1024) for h in heads]
    calls = []
    real = ht.records_features
    monkeypatch.setattr(ht, "records_features", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache: dict = {}
    shared = [per_record(h, target, recs[:6], 1024, cache) for h in heads]
    assert len(calls) == 1 and list(cache) == [tuple(LAYERS)]
    assert shared == alone and alone[0] != alone[1]


@pytest.mark.pure
@pytest.mark.usefixtures("one_thread")
def test_a_few_steps_on_a_fixed_pattern_raise_the_heads_alpha_and_pass_the_paired_gate(target, recs):
    """The trainer's head pieces (batch, loss, rebuild) over records of the target's greedy
    pattern: α rises, and the paired gate (each draft scored by its family) sees it."""
    from infra.drafts.layer import build_draft
    from train.distill.head import evaluate
    from train.online.family import HeadFamily, per_record
    from train.gate.compare import gate

    head = fresh_head(target)
    fam = HeadFamily(target, train_cfg(max_seq_len=1024), head)
    train, held = recs[:18], recs[18:]
    before = evaluate(head, fam.features(held))["alpha_est"]
    start = per_record(head, target, held, 1024)
    engine, loss_fn = _TorchEngine(head), fam.loss_fn()
    losses = [engine.train_batch(fam.batch(train[i:i + 6]), loss_fn) for _ in range(15) for i in (0, 6, 12)]
    trained = fam.rebuild({n: p.detach() for n, p in head.named_parameters()})  # as an export rebuilds it
    after = evaluate(trained, fam.features(held))["alpha_est"]
    assert losses[-1] < losses[0] and after > before + 0.1, (before, after)
    end = per_record(trained, target, held, 1024)
    assert [n for _, n in end] == [n for _, n in start] == [24] * len(held)
    ev = gate([s for s, _ in end], [s for s, _ in start], [n for _, n in end], stable_version="v0",
              min_records=len(held), resamples=300)
    assert ev["passed"] and ev["candidate_alpha"] > ev["stable_alpha"], ev["reason"]
    # A layer draft is scored on the same positions, so the families pair up in the gate.
    layer = per_record(build_draft(target, DraftSpec(num_layers=1)), target, held, 1024)
    assert [n for _, n in layer] == [n for _, n in end]


@pytest.mark.pure
@pytest.mark.usefixtures("one_thread")
def test_a_head_family_steps_and_scores_in_bfloat16_only_where_bfloat16_is_native(target, recs, monkeypatch):
    """The online head trainer takes its warm start's rule (train/distill/ds_engine.py
    autocast_dtype): the trainer's DistillEngine gets the family's dtype, and the gate's scores
    (the α estimate's too) run the head under it; float32 on a CPU that would emulate bfloat16."""
    import infra.common.cpu
    from train.online.family import HeadFamily, LayerFamily

    head = fresh_head(target, 150)
    seen: list = []
    head.fc.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    for native, dtype in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(infra.common.cpu, "native_bf16_gemm", lambda native=native: native)
        fam = HeadFamily(target, train_cfg(max_seq_len=1024), head)
        assert fam.autocast == (torch.bfloat16 if native else None)
        seen.clear()
        fam.score(head, recs[:2])
        assert seen and set(seen) == {dtype}
    assert LayerFamily.autocast is None


@pytest.mark.pure
@pytest.mark.usefixtures("one_thread")
def test_the_loss_takes_float32_targets_under_bfloat16_autocast(target, recs):
    """Under bfloat16 autocast the target's logits over the draft vocab come out bfloat16; the
    loss takes its soft targets from them in float32, not as a bfloat16 softmax."""
    import torch.nn.functional as F
    from train.distill.head import DEPTH, DECAY, head_loss_fn
    from train.online.family import HeadFamily

    head = fresh_head(target, 150)
    b = HeadFamily(target, train_cfg(max_seq_len=1024), head).batch(recs[:3])
    w = target.lm_head.weight.detach()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = head_loss_fn(w)(head, b)
        z = b.final @ w[head.d2t].T
        assert z.dtype == torch.bfloat16
        p = torch.softmax(z.float(), dim=-1)
        in_vocab = head.t2d()[b.target_argmax.clamp(min=0)] & b.valid
        t = torch.arange(b.valid.shape[1])
        want = torch.zeros(())
        for j, logits in enumerate(head(b.feats, b.next_ids, DEPTH), start=1):
            m = (in_vocab & (t >= j - 1)).float()
            ce = -(p * F.log_softmax(logits, dim=-1)).sum(-1)
            want = want + DECAY ** (j - 1) * (ce * m).sum() / m.sum().clamp(min=1)
    assert float(got) == pytest.approx(float(want), rel=1e-6)


@pytest.mark.pure
def test_a_head_trainer_without_an_init_draft_fails_clearly(tmp_path):
    from infra.config import load_config
    from train.online.trainer import TrainerWorker

    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path), "model": {"target": "tiny-random"}})
    w = TrainerWorker(cfg.model_dump(mode="json"), 0, 1, str(tmp_path / "run"), family="head")
    with pytest.raises(ValueError, match="run `osd draft init --family head` and pass it as the init draft"):
        w.setup("127.0.0.1", 0)


@pytest.mark.pure
@pytest.mark.usefixtures("one_thread")
def test_a_family_mismatch_is_refused_at_setup(tmp_path):
    """Refused before the rendezvous (no process group is ever joined here)."""
    from infra.config import load_config
    from infra.target import load_target
    from train.online.trainer import TrainerWorker

    d = save_head(build_head(load_target("tiny-random", progress=False).model, DraftSpec(family="head")),
                  tmp_path / "head", target_ref={"spec": "tiny-random"})
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path), "model": {"target": "tiny-random"}})
    w = TrainerWorker(cfg.model_dump(mode="json"), 0, 1, str(tmp_path / "run"), init_draft=str(d), family="layer")
    with pytest.raises(ValueError, match="asked to train a layer draft; .* is a head draft"):
        w.setup("127.0.0.1", 0)


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [2, 3])
def test_a_group_started_from_a_head_trains_and_publishes_head_versions(ray_local, stream, records, tmp_path,  # noqa: F811
                                                                        stage):
    """Two ranks (one may step on a null batch while the other has data), a layer version as
    stable: the head candidates are gated against it, each scored by its family."""
    from infra.drafts.head import HeadDraft, top_tokens
    from infra.drafts.layer import build_draft, load_draft, save_draft
    from infra.registry import Registry
    from infra.target import load_target
    from pipeline.teacher.served_forward import served_forward
    from train.online.trainer import TrainerGroup

    # bootstrap: every candidate published at its checkpoint, with its evidence (the sequential
    # gate, which publishes only candidates the held-out records favour, is tested on its own)
    cfg = stream(zero_stage=stage, held_out_every=4, gate={"method": "bootstrap", "min_records": 1, "resamples": 200},
                 replay_steps=1)
    target = load_target("tiny-random", progress=False).model
    counts = torch.bincount(torch.cat([torch.as_tensor(r.output_ids).long() for r in records]), minlength=259)
    init = save_head(build_head(target, DraftSpec(family="head", draft_vocab=200), top_tokens(counts, 200)),
                     tmp_path / "head-v1", target_ref={"spec": "tiny-random"})
    reg = Registry.from_config(cfg)
    save_draft(build_draft(target, DraftSpec(num_layers=1)), DraftSpec(num_layers=1), tmp_path / "layer",
               target_ref={"spec": "tiny-random"})
    reg.publish(tmp_path / "layer", "layer-v1")
    reg.promote("layer-v1")
    produce(cfg, records)
    # The factory reaches the actors (a float32 target: it answers with the float32 copy's features).
    group = TrainerGroup(cfg, tmp_path / "run", init_draft=str(init), served=served_forward)
    try:
        stats = group.run(idle_stop_s=3, timeout=300)
    finally:
        group.shutdown()
    assert group_state(cfg) == (0, 0)  # every record delivered and acked
    assert sum(s.steps for s in stats) > 0 and all(s.replay_steps for s in stats if s.steps)
    exports = stats[0].exports
    assert exports and exports[0]["parent"] == "head-v1" and all(e["family"] == "head" for e in exports)
    published = reg.get(exports[-1]["version"])
    path = reg.payload_dir(published)
    assert json.loads((path / "draft.json").read_text())["spec"]["family"] == "head"
    head, info = load_draft(path, target)
    assert isinstance(head, HeadDraft) and torch.equal(head.d2t, top_tokens(counts, 200).to(head.d2t.device))
    m = published.metrics
    assert m["alpha_est"] is not None and 0 <= m["alpha_est"] <= 1
    ev = m["gate"]
    assert ev["stable"] == "layer-v1" and "passed" in ev and ev["reason"] and "diff" in ev, ev
    assert ev["records"] == len(ev["per_record"]) > 0
    # The published head is the final checkpoint's consolidated weights.
    from safetensors.torch import load_file

    ckpt = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[-1]
    params = dict(head.named_parameters())
    for name, w in load_file(str(ckpt / "consolidated.safetensors")).items():
        assert torch.equal(params[name].detach(), w), name


@pytest.mark.pure
def test_osd_train_with_the_head_family_and_no_init_draft_exits_before_starting_ray(capsys, monkeypatch):
    import ray

    from pipeline.cli import main

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init called"))
    assert main(["train", "--family", "head", "--max-records", "1"]) == 2
    assert "osd draft init --family head" in capsys.readouterr().err


@pytest.mark.pure
def test_a_refusal_at_setup_is_raised_once_not_restarted(monkeypatch, tmp_path):
    """A ValueError from the workers (a setting or a draft they refuse) would be the same after a
    restart; a worker that died is restarted."""
    import ray.exceptions as rex

    import train.online.trainer as trainer
    from infra.config import load_config

    starts = []

    class Group:
        def __init__(self, *a, **k):
            starts.append(k)

        def run(self, **kw):
            raise failure.as_instanceof_cause()

        def shutdown(self):
            pass

    monkeypatch.setattr(trainer, "TrainerGroup", Group)
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    failure = rex.RayTaskError("setup", "tb", ValueError("anchor_kl is for layer drafts only"))
    with pytest.raises(ValueError, match="anchor_kl") as info:
        trainer.run_with_restarts(cfg, tmp_path / "run", restarts=2, family="head")
    assert not isinstance(info.value, rex.RayTaskError)
    assert len(starts) == 1 and starts[0]["family"] == "head"
    failure = rex.RayTaskError("run", "tb", RuntimeError("worker lost"))
    starts.clear()
    with pytest.raises(RuntimeError, match="training failed after 2 restarts"):
        trainer.run_with_restarts(cfg, tmp_path / "run", restarts=2, sleep=lambda s: None)
    assert len(starts) == 3
