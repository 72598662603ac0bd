"""The head draft family (infra/drafts/head.py, serve/spec_decode/head/draft.py) on tiny random Llamas.

The head's forward is checked against a direct computation through Hugging Face's own decoder
layer; the serving path (rows + own-state feedback) against the training unroll; the engine's
output against the target alone (greedy identical, sampled exact by chi-square), with target
tokens outside the draft vocabulary.
"""

import json

import pytest
import torch
import torch.nn.functional as F

from chi2 import chi2_pvalue
from infra.drafts.head import build_head, default_feature_layers, save_head
from infra.drafts.layer import load_draft
from infra.drafts.spec import DraftSpec
from infra.target import build_tiny_llama
from serve.engine.core import GenerationParams, SpecEngine
from engine_options import small_options
from serve.spec_decode.head.draft import HeadRunner
from serve.model.runner import HFRunner, LlamaRunner
from serve.sampling.verify import SamplingParams, warp_probs

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]

LAYERS = (1, 2, 4)


def tiny(seed=0, layers=6, **kw):
    m = build_tiny_llama(seed=seed, num_layers=layers, max_positions=kw.pop("max_positions", 128), **kw)
    m.config.eos_token_id = m.generation_config.eos_token_id = None
    return m


def randomised(head, seed=0, scale=0.2):
    """The head with every weight perturbed, so no test passes by the copy-of-target init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return head


@pytest.fixture(scope="module")
def target():
    return tiny(0)


@pytest.fixture(scope="module")
def head(target):
    d2t = torch.randperm(259, generator=torch.Generator().manual_seed(1))[:150]
    return randomised(build_head(target, DraftSpec(family="head", feature_layers=LAYERS), d2t))


def hf_features(target, ids):
    with torch.no_grad():
        out = target(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0], torch.cat([out.hidden_states[i + 1][0] for i in LAYERS], dim=-1)


def reference_logits(target, head, feats, next_ids):
    """Depth-1 head logits [T, V_d] through HF's LlamaDecoderLayer holding the head's weights."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

    cfg = target.config
    layer = LlamaDecoderLayer(cfg, 0).eval()
    sd = {f"{m}.{n}.weight": head.layer[n].weight for m, names in
          (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))
          for n in names}
    sd.update({"input_layernorm.weight": head.ln1, "post_attention_layernorm.weight": head.ln2})
    layer.load_state_dict({k: v.detach() for k, v in sd.items()})

    def rms(x, w):
        n = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        n.weight.data.copy_(w)
        return n(x)

    with torch.no_grad():
        g = feats @ head.fc.weight.T
        e = target.model.embed_tokens(next_ids)
        x = torch.cat([rms(e, head.norm_e), rms(g, head.norm_g)], -1) @ head.in_proj.weight.T
        t = x.shape[0]
        pos = torch.arange(t).unsqueeze(0)
        cos_sin = target.model.rotary_emb(x.unsqueeze(0), pos)
        mask = torch.full((t, t), float("-inf")).triu(1).view(1, 1, t, t)
        o = layer(x.unsqueeze(0), attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        o = o[0] if isinstance(o, tuple) else o
        return (rms(o[0], head.norm) @ head.lm_head.weight.T).float()


def test_default_feature_layers_are_eagle3s():
    assert default_feature_layers(30) == (1, 14, 26)
    assert all(0 <= i < 2 for i in default_feature_layers(2))


@pytest.mark.parametrize("runner_cls", [LlamaRunner, HFRunner])
def test_runner_features_are_the_targets_layer_outputs(target, runner_cls):
    ids = [5, 17, 200, 3, 99, 45, 8]
    logits_ref, feats_ref = hf_features(target, ids)
    r = runner_cls(target, 64)
    cache = r.new_cache()
    a_logits, a_feats = r.forward_features(torch.tensor(ids[:4]), cache, LAYERS)
    b_logits, b_feats = r.forward_features(torch.tensor(ids[4:]), cache, LAYERS)
    assert torch.allclose(torch.cat([a_feats, b_feats]), feats_ref, atol=1e-4, rtol=1e-4)
    assert torch.allclose(torch.cat([a_logits, b_logits]), logits_ref, atol=1e-4, rtol=1e-4)


def test_head_forward_matches_direct_reference(target, head):
    ids = [5, 17, 200, 3, 99, 45, 8, 250, 31]
    _, feats = hf_features(target, ids)
    nxt = torch.tensor(ids[1:])
    ref = reference_logits(target, head, feats[:-1], nxt)
    with torch.no_grad():
        got = head.unroll(feats[:-1].unsqueeze(0), nxt.unsqueeze(0), 1)[0][0]
    assert got.shape == (len(ids) - 1, head.draft_vocab)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    # Serving, in two chunks through the KV cache, gives the same last-row logits.
    runner = HeadRunner(head, 64)
    cache = runner.new_cache()
    runner.rows(runner.fuse(feats[:3]), nxt[:3], cache)
    last, _ = runner.rows(runner.fuse(feats[3:-1]), nxt[3:], cache)
    assert torch.allclose(last, ref[-1], atol=1e-4, rtol=1e-4)


def test_unroll_depths_equal_drafting_on_own_state(target, head):
    """Depth j of the training unroll at row r is what serving computes for the j-th draft of a
    chain that starts at row r-j+1 (true tokens as the accepted drafts)."""
    ids = [5, 17, 200, 3, 99, 45, 8, 250, 31, 77]
    _, feats = hf_features(target, ids)
    nxt = torch.tensor(ids[1:])
    rows = len(ids) - 1
    with torch.no_grad():
        unrolled = head.unroll(feats[:-1].unsqueeze(0), nxt.unsqueeze(0), 3)
    runner = HeadRunner(head, 64)
    for s in (2, 5):  # chain start: target rows 0..s
        cache = runner.new_cache()
        logits, g = runner.rows(runner.fuse(feats[: s + 1]), nxt[: s + 1], cache)
        assert torch.allclose(logits, unrolled[0][0, s], atol=1e-4, rtol=1e-4)
        for j in (2, 3):
            if s + j - 1 >= rows:
                break
            logits, g = runner.rows(g, nxt[s + j - 1: s + j], cache)
            assert torch.allclose(logits, unrolled[j - 1][0, s + j - 1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("first", [0, 1, 4])
def test_an_unroll_from_a_later_row_equals_the_full_unroll_on_chains_from_that_row(target, head, first):
    """unroll_states(first=f) gives rows f.. of each depth; depth j's rows from f+j-1 (chains
    that start at f or later) equal the full unroll's, and so do the LM head's logits on them."""
    ids = [5, 17, 200, 3, 99, 45, 8, 250, 31, 77]
    _, feats = hf_features(target, ids)
    f, n = feats[:-1].unsqueeze(0), torch.tensor([ids[1:]])
    with torch.no_grad():
        full = head.unroll_states(f, n, 3)
        part = head.unroll_states(f, n, 3, first)
        logits = head.unroll(f, n, 3)
    rows = len(ids) - 1
    for j, (a, b, z) in enumerate(zip(full, part, logits), start=1):
        assert b.shape == (1, rows - first, a.shape[-1])
        kept = slice(first + j - 1, rows)
        assert torch.allclose(b[0, j - 1:], a[0, kept], atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            assert torch.allclose(head.logits(b[0, j - 1:]), z[0, kept], atol=1e-4, rtol=1e-4)


def test_an_unroll_in_windows_per_record_equals_each_record_s_own_unroll(target, head):
    """unroll_windows: in a right-padded batch of records of different lengths, window row w of
    record b (sequence row first[b] + w) at depth j equals that record's own full unroll at that
    row, for chains that start inside the window; the windows are as wide as asked."""
    seqs = [[5, 17, 200, 3, 99, 45, 8, 250, 31, 77], [42, 7, 130, 12, 9], [11, 13, 17, 19, 23, 29, 31]]
    feats = [hf_features(target, ids)[1][:-1] for ids in seqs]
    nxt = [torch.tensor(ids[1:]) for ids in seqs]
    pad = torch.nn.utils.rnn.pad_sequence
    f, n = pad(feats, batch_first=True), pad(nxt, batch_first=True)
    first = torch.tensor([6, 0, 2])
    width = max(len(ids) - 1 - int(s) for ids, s in zip(seqs, first))
    with torch.no_grad():
        win = head.unroll_windows(f, n, 3, first, width)
        own = [head.unroll_states(x.unsqueeze(0), y.unsqueeze(0), 3) for x, y in zip(feats, nxt)]
    assert all(o.shape == (3, width, f.shape[-1] // 3) for o in win)
    for b, ids in enumerate(seqs):
        for j in (1, 2, 3):
            for w in range(j - 1, len(ids) - 1 - int(first[b])):
                row = int(first[b]) + w
                assert torch.allclose(win[j - 1][b, w], own[b][j - 1][0, row], atol=1e-5, rtol=1e-5), (b, j, w)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("prompt", [[17, 200, 3, 99, 45], [42]])
def test_greedy_output_equals_target_greedy(target, head, k, prompt):
    eng = SpecEngine(target, head, options=small_options(k=k, max_seq_len=128, max_concurrency=1))
    r = eng.generate(prompt, GenerationParams(max_new_tokens=30))
    ar = eng.generate(prompt, GenerationParams(max_new_tokens=30, speculate=False))
    with torch.no_grad():
        ref = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=30)[0, len(prompt):].tolist()
    assert r.output_ids == ref == ar.output_ids
    assert r.stats.num_draft_tokens > 0


def test_a_head_equal_to_the_target_on_its_vocab_is_accepted(target):
    """Sanity of the proposal path: a head whose draft vocab covers every target token and
    whose state is trained nowhere still proposes only in-vocab ids, and greedy stays exact
    across concurrent requests (separate feature buffers per request)."""
    d2t = torch.arange(40, 240)
    h = randomised(build_head(target, DraftSpec(family="head", feature_layers=LAYERS), d2t), seed=3)
    eng = SpecEngine(target, h, options=small_options(k=3, max_seq_len=128, max_concurrency=2))
    r = eng.generate([1, 2, 3], GenerationParams(max_new_tokens=24))
    assert set(r.capture.draft_tokens[r.capture.draft_tokens >= 0].tolist()) <= set(d2t.tolist())


V8 = dict(vocab_size=8, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32)


def test_sampling_is_exact_with_target_tokens_outside_the_draft_vocab():
    target = tiny(3, layers=3, **V8)
    d2t = torch.tensor([0, 2, 3, 5, 6])  # 1, 4, 7 are target tokens the head cannot propose
    head = randomised(build_head(target, DraftSpec(family="head", feature_layers=(0, 1, 2)), d2t), seed=2, scale=0.5)
    sp = SamplingParams(temperature=1.0)
    prompt, k, n = [1, 2, 3], 2, 2000
    eng = SpecEngine(target, head, options=small_options(k=k, max_seq_len=32))
    counts = torch.zeros(8, 8, dtype=torch.long)
    drafted = accepted = 0
    for i in range(n):
        r = eng.generate(prompt, GenerationParams(max_new_tokens=k + 1, capture=False,
                                                  sampling=SamplingParams(1.0, seed=i)))
        counts[r.output_ids[0], r.output_ids[1]] += 1
        drafted += r.stats.num_draft_tokens
        accepted += r.stats.num_accepted_tokens
    assert 0.05 < accepted / drafted < 0.95 and drafted - accepted > 300
    with torch.no_grad():
        p1 = warp_probs(target(torch.tensor([prompt])).logits[0, -1], sp)
        p2 = warp_probs(target(torch.tensor([prompt + [t] for t in range(8)])).logits[:, -1], sp)
    exact = p1[:, None] * p2
    assert counts[[1, 4, 7]].sum() > 0  # out-of-vocab targets were emitted (by the residual)
    assert chi2_pvalue(counts, exact) > 1e-3


def test_save_load_round_trip_and_registry_check(tmp_path, target, head):
    from infra.registry import check_draft_dir

    ref = {"spec": "tiny-random", "sha256": "a" * 64}
    d = save_head(head, tmp_path / "h1", target_ref=ref, metrics={"alpha_est": 0.5})
    info = json.loads((d / "draft.json").read_text())
    assert info["spec"]["family"] == "head" and info["draft_vocab"] == head.draft_vocab
    check_draft_dir(d)
    loaded, linfo = load_draft(d, target, expect_target_sha256="a" * 64)
    assert torch.equal(loaded.d2t, head.d2t)
    for (n, p), (_, q) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(p, q), n
    assert loaded.embed.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    from infra.drafts.spec import DraftLoadError

    with pytest.raises(DraftLoadError, match="not this one"):
        load_draft(d, target, expect_target_sha256="b" * 64)
    with pytest.raises(DraftLoadError):
        load_draft(d, tiny(0, hidden_size=32, num_heads=2, num_kv_heads=1))


def test_layer_drafts_keep_their_draft_json(tmp_path, target):
    from infra.drafts.layer import build_draft, save_draft

    spec = DraftSpec(num_layers=1)
    d = save_draft(build_draft(target, spec), spec, tmp_path / "l1", target_ref={"spec": "x", "sha256": None})
    assert "family" not in json.loads((d / "draft.json").read_text())["spec"]
    model, _ = load_draft(d, target)
    assert model.config.num_hidden_layers == 1


def test_greedy_stays_exact_through_partial_acceptances():
    """A small vocab makes a random head agree often, so steps accept 1..k-1 drafts and the
    feature bookkeeping across steps (commit_head) is exercised."""
    target = tiny(5, layers=3, **dict(V8, max_positions=128))
    head = randomised(build_head(target, DraftSpec(family="head", feature_layers=(0, 1, 2)),
                                 torch.tensor([0, 1, 2, 3, 5, 6, 7])), seed=4, scale=0.3)
    eng = SpecEngine(target, head, options=small_options(k=3, max_seq_len=128, k_policy="fixed"))
    prompt = [1, 2, 3, 4]
    r = eng.generate(prompt, GenerationParams(max_new_tokens=60))
    with torch.no_grad():
        ref = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=60)[0, len(prompt):].tolist()
    assert r.output_ids == ref
    st = r.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens and st.accepted_per_pos[1] > 0
    # Per-position acceptance for the bench: drafted counts every step that proposed there.
    assert st.drafted_per_pos[0] == st.num_drafts and sum(st.drafted_per_pos) == st.num_draft_tokens
    assert all(a <= d for a, d in zip(st.accepted_per_pos, st.drafted_per_pos))
    # Reached at i: drafted at i with 0..i-1 accepted, so reached[i] = accepted[i-1] without a
    # confidence stop (every step drafts k), and rejections = reached - accepted, one per step at most.
    assert st.reached_per_pos[0] == st.drafted_per_pos[0]
    assert st.reached_per_pos[1:] == st.accepted_per_pos[:-1]
    assert sum(r - a for r, a in zip(st.reached_per_pos, st.accepted_per_pos)) <= st.num_drafts


class _TorchEngine:
    """DistillEngine's train_batch contract over plain AdamW (pure tests run without DeepSpeed)."""

    def __init__(self, model, lr=3e-3):
        self.model = model
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)

    def train_batch(self, batch, loss_fn):
        self.model.train()
        loss = loss_fn(self.model, batch)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return float(loss.detach())


def test_training_a_few_steps_raises_the_unrolled_estimate():
    from train.distill.head import compute_features, estimate_alpha_head, evaluate, head_loss_fn, train_epochs

    target = tiny(7, layers=4, max_positions=128)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 259, (6,), generator=g).tolist() for _ in range(24)]
    with torch.no_grad():
        seqs = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=24)[0].tolist() for p in prompts]
    layers = (0, 1, 2)
    train = compute_features(target, seqs[:20], layers, starts=[6] * 20)
    held = compute_features(target, seqs[20:], layers, starts=[6] * 4)
    # The features are the runner's: the same numbers serving will feed the head.
    r = LlamaRunner(target, 64)
    _, f = r.forward_features(torch.tensor(seqs[0]), r.new_cache(), layers)
    assert torch.allclose(train.feats[0].float(), f, atol=0.05, rtol=0.02)
    head = build_head(target, DraftSpec(family="head", feature_layers=layers, draft_vocab=259))
    before = evaluate(head, held)
    losses = train_epochs(_TorchEngine(head), train, head_loss_fn(target.lm_head.weight.detach()), epochs=15,
                          token_budget=256, log=lambda s: None)
    after = evaluate(head, held)
    # The same estimate straight from served records (prompt + output), as an online trainer has them.
    import numpy as np

    from infra.records.schema import Record

    recs = [Record(request_id=str(i), draft_version="x", prompt_ids=np.array(s[:6], np.int32),
                   output_ids=np.array(s[6:], np.int32), topk_ids=np.zeros((len(s) - 6, 1), np.int32),
                   topk_logprobs=np.zeros((len(s) - 6, 1), np.float16), accepted=np.zeros(len(s) - 6, bool),
                   draft_tokens=np.full(len(s) - 6, -1, np.int32), draft_probs=np.zeros(len(s) - 6, np.float32))
            for i, s in enumerate(seqs[20:])]
    assert estimate_alpha_head(head, target, recs) == pytest.approx(after["alpha_est"], abs=0.02)
    assert losses[-1] < losses[0]
    assert after["alpha_est"] > before["alpha_est"] + 0.1, (before, after)
    assert len(after["agree_per_depth"]) == 3 and after["coverage"] == 1.0
    # The trained head in the engine: greedy still the target's, and now drafts get accepted.
    eng = SpecEngine(target, head, options=small_options(k=3, max_seq_len=128))
    res = eng.generate(prompts[21], GenerationParams(max_new_tokens=20))
    assert res.output_ids == seqs[21][6:26]
    assert res.stats.num_accepted_tokens > 0


def test_features_of_a_padded_batch_are_each_sequences_own(target):
    """Long and short sequences in one right-padded batch: each keeps its own length, and the
    stored argmax is the target's own at every position (no padding rows leak in)."""
    from train.distill.head import compute_features

    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 259, (n,), generator=g).tolist() for n in (300, 7)]
    fs = compute_features(target, seqs, LAYERS)
    for ids, am, f in zip(seqs, fs.argmax, fs.feats):
        logits, feats = hf_features(target, ids)
        assert am.shape == (len(ids),) and f.shape == (len(ids), feats.shape[1])
        assert (am == logits.argmax(-1)).float().mean() > 0.99  # bf16 storage aside, the same


def test_registry_version_of_a_head_swaps_in_beside_a_layer_draft(tmp_path, target, head):
    """A head published to the registry loads by version id (digests checked) and serves as a
    per-request draft of an engine whose own draft is a layer draft: the hot-swap path."""
    from infra.drafts.layer import build_draft
    from infra.registry import Registry

    reg = Registry((tmp_path / "reg").as_uri(), cache_dir=tmp_path / "cache")
    d = save_head(head, tmp_path / "h", target_ref={"spec": "tiny-random", "sha256": "c" * 64})
    v = reg.publish(d, "head-v1")
    model, info = reg.load_draft(v.id, target, expect_target_sha256="c" * 64)
    assert info["spec"]["family"] == "head" and info["version"] == "head-v1"
    eng = SpecEngine(target, build_draft(target, DraftSpec(num_layers=2)),
                     options=small_options(k=3, max_seq_len=128, max_concurrency=1))
    runner = eng.make_draft(model)
    prompt = [17, 200, 3, 99, 45]
    a = eng.generate(prompt, GenerationParams(max_new_tokens=20), draft=runner)
    b = eng.generate(prompt, GenerationParams(max_new_tokens=20))
    assert a.output_ids == b.output_ids and a.stats.num_draft_tokens > 0


def test_each_steps_drafts_are_the_unroll_of_the_committed_sequence(monkeypatch):
    """Across steps that accept 1..k-1 drafts, every draft the engine proposes equals the
    training unroll over the sequence as committed at that step: depth j at row N-3+j, the
    earlier drafts as next tokens (N committed tokens). A stale or misplaced feature or cache
    row after a partial acceptance would change later drafts without breaking greedy output."""
    from serve.spec_decode.head.draft import HeadRunner

    target = tiny(5, layers=3, **dict(V8, max_positions=128))
    layers = (0, 1)  # HF's last hidden state is after the final norm; the runner's is before it
    head = randomised(build_head(target, DraftSpec(family="head", feature_layers=layers),
                                 torch.tensor([0, 1, 2, 3, 5, 6, 7])), seed=4, scale=0.3)
    steps = []

    def recording(runner, seqs, ks, ctx):
        out = real_propose(runner, seqs, ks, ctx)
        steps.extend((list(seq.tokens), p.tokens.tolist()) for seq, p in zip(seqs, out))
        return out

    real_propose = HeadRunner.propose
    monkeypatch.setattr(HeadRunner, "propose", recording)
    eng = SpecEngine(target, head, options=small_options(k=3, max_seq_len=128, k_policy="fixed"))
    eng.generate([1, 2, 3, 4], GenerationParams(max_new_tokens=40))
    assert len(steps) > 5 and any(0 < len(d) for _, d in steps)
    for committed, drafts in steps:
        ids = committed + drafts
        with torch.no_grad():
            out = target(torch.tensor([committed]), output_hidden_states=True)
            feats = torch.cat([out.hidden_states[i + 1][0] for i in layers], dim=-1)
            feats = torch.cat([feats, feats.new_zeros(len(drafts), feats.shape[1])])  # unread rows
            unrolled = head.unroll(feats[:-1].unsqueeze(0), torch.tensor([ids[1:]]), len(drafts))
        n = len(committed)
        got = [int(head.d2t[unrolled[j][0, n - 2 + j].argmax()]) for j in range(len(drafts))]
        assert got == drafts, (n, drafts, got)


def _loss_and_grads(head, fn, batch):
    head.zero_grad()
    loss = fn(head, batch)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tv, ce", [(0.0, 1.0), (1.0, 0.0), (0.5, 1.0)])
@pytest.mark.parametrize("rows", ["outputs", "all"])
def test_the_loss_is_the_full_unrolls_loss_on_the_rows_it_counts(target, head, rows, tv, ce):
    """The LM head runs on the counted rows alone, from the batch's first chain start: the loss
    and its gradients equal the full unroll's soft cross-entropy (and, weighted by tv, total
    variation) masked to rows t >= start (rows="outputs", the online trainer's) or every
    in-vocab row (rows="all", the warm start's), and t >= j-1 at depth j, computed here directly."""
    from train.distill.head import collate, compute_features, head_loss_fn

    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 259, (n,), generator=g).tolist() for n in (30, 22, 41)]
    fs = compute_features(target, seqs, LAYERS, starts=[9, 14, 6])  # starts 7, 12, 4: first = 2
    batch = collate(fs, range(3))
    w = target.lm_head.weight.detach()

    def reference(model, b):
        p = torch.softmax((b.final @ w[model.d2t].T).float(), -1)
        in_vocab = model.t2d()[b.target_argmax.clamp(min=0)] & b.valid
        t = torch.arange(b.valid.shape[1])
        total = torch.zeros(())
        for j, logits in enumerate(model.unroll(b.feats, b.next_ids, 3), start=1):
            counted_from = b.start if rows == "outputs" else torch.zeros_like(b.start)
            m = (in_vocab & (t >= j - 1) & (t.view(1, -1) >= counted_from.view(-1, 1))).float()
            q = torch.softmax(logits, -1)
            per_row = -ce * (p * q.log()).sum(-1) + tv * 0.5 * (p - q).abs().sum(-1)
            total = total + 0.8 ** (j - 1) * (per_row * m).sum() / m.sum()
        return total

    got, got_g = _loss_and_grads(head, head_loss_fn(w, rows=rows, tv=tv, ce=ce), batch)
    want, want_g = _loss_and_grads(head, reference, batch)
    assert got == pytest.approx(want, rel=1e-5)
    assert got_g.keys() == want_g.keys()
    for n in want_g:
        assert torch.allclose(got_g[n], want_g[n], atol=1e-6, rtol=1e-4), n
    other, _ = _loss_and_grads(head, head_loss_fn(w, rows="all" if rows == "outputs" else "outputs", tv=tv, ce=ce),
                               batch)
    assert other != pytest.approx(got, rel=1e-3)  # the prompt rows count in one and not the other


@pytest.mark.parametrize("rows", ["outputs", "all"])
def test_the_loss_of_a_null_batch_is_zero_and_attached(target, head, rows):
    from train.distill.head import head_loss_fn, null_head_batch

    h = target.config.hidden_size
    loss = head_loss_fn(target.lm_head.weight.detach(), rows=rows)(head, null_head_batch(len(LAYERS) * h, h))
    assert float(loss.detach()) == 0.0 and loss.requires_grad
    loss.backward()


def test_an_unknown_loss_row_choice_is_refused(target):
    from train.distill.head import head_loss_fn

    with pytest.raises(ValueError, match="rows must be"):
        head_loss_fn(target.lm_head.weight.detach(), rows="prompt")
    for tv, ce in ((0.0, 0.0), (-1.0, 1.0), (1.0, -0.5)):
        with pytest.raises(ValueError, match="tv and ce are weights"):
            head_loss_fn(target.lm_head.weight.detach(), tv=tv, ce=ce)


class _Cache:
    """A head cache's length, as commit_head reads and truncates it."""

    def __init__(self, length: int = 0):
        self.length = length

    def truncate(self, n: int) -> None:
        self.length = min(self.length, n)


class _Seq:
    def __init__(self, cache_length: int = 0):
        self.dcache = _Cache(cache_length)
        self.draft_state = {}


def test_a_head_that_does_not_draft_keeps_its_backlog_in_pieces_joined_once_when_read():
    """While the head drafts nothing (the suffix draft takes the steps, or a batch's gate holds
    drafting back) each commit adds its rows as a piece: no step copies the whole backlog."""
    from serve.spec_decode.head.draft import commit_head, head_state

    seq = _Seq(cache_length=3)
    head_state(seq).feats, head_state(seq).feat_start = torch.zeros(0, 4), 3  # a prompt the head has cached
    rows = torch.arange(40.0).reshape(10, 4)
    for step in range(10):  # one committed row a step, rows 3..12; the cache stays at 3 rows
        commit_head(seq, base=4 + step, feats=rows[step:step + 1])
    st = head_state(seq)
    assert len(st.pieces) == 11 and st.feat_start == 3
    # each piece is its own row, not a view holding the step's whole feature output
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in st.pieces)
    assert torch.equal(st.feats, rows) and len(st.pieces) == 1  # joined when read, once
    assert torch.equal(st.feats[2:], rows[2:])


def test_a_commit_after_the_head_drafted_drops_the_rows_its_cache_took():
    """The head's proposal cached backlog rows (and a draft row); the commit keeps target rows
    only and the backlog starts where the cache ends, as before the pieces."""
    from serve.spec_decode.head.draft import HeadState, commit_head, head_state

    seq = _Seq(cache_length=3)
    st = head_state(seq)
    st.feats, st.feat_start = torch.arange(12.0).reshape(3, 4), 3  # rows 3, 4, 5
    seq.dcache.length = 7  # the proposal cached rows 3..5 and one draft row
    new = torch.full((2, 4), -1.0)  # this step committed two: rows 6, 7
    commit_head(seq, base=7, feats=new)
    assert seq.dcache.length == 6 and st.feat_start == 6
    assert torch.equal(st.feats, new)
    empty = HeadState()
    assert empty.feats is None
    empty.drop_before(5)
    assert empty.feat_start == 5 and empty.feats is None
