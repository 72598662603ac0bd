"""serve/engine/core.py, runner.py, capture.py, drafts.py on tiny random Llamas built in-process.

Losslessness is checked against the target alone: greedy output against HF `generate`,
sampled output against the target's exact distribution (chi-square at a fixed seed).
"""

import asyncio
import copy
import itertools

import numpy as np
import pytest
import torch

from chi2 import chi2_pvalue
from infra.target import build_tiny_llama, tiny_tokenizer
from serve.spec_decode.specs import DraftSpecError, build_draft
from serve.engine.core import EngineError, GenerationParams, RequestError, SpecEngine
from engine_options import small_options
from serve.model.runner import HFRunner, LlamaRunner, StaticKVCache
from serve.model.factory import make_runner
from serve.sampling.verify import SamplingParams, warp_probs

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]


def tiny(seed: int = 0, layers: int = 2, eos: bool = False, **kw):
    """A tiny random Llama; EOS off unless asked, so greedy runs have a fixed length."""
    m = build_tiny_llama(seed=seed, num_layers=layers, max_positions=kw.pop("max_positions", 128), **kw)
    if not eos:
        m.config.eos_token_id = None
    return m


def hf_greedy(model, prompt, n: int, eos: bool = False) -> list[int]:
    """The target's own greedy decoding through HF generate (no EOS stop unless asked)."""
    gc = model.generation_config
    saved = gc.eos_token_id
    if not eos:
        gc.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)
    finally:
        gc.eos_token_id = saved
    return out[0, len(prompt):].tolist()


def full_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def only_slot(engine: SpecEngine):
    """The KV slot of an engine built with max_concurrency=1 (it is idle between calls)."""
    assert engine.slots.total == engine.slots.free == 1
    return engine.slots._free[0]


# ---------------------------------------------------------------- greedy losslessness

PROMPTS = {0: [[17, 200, 3, 99, 45], [42]], 1: [[1, 2, 3, 4, 5, 6, 7], [250]]}
N_NEW = 24


@pytest.fixture(scope="module")
def greedy_targets():
    out = {}
    for seed, prompts in PROMPTS.items():
        target = tiny(seed, layers=4)
        drafts = {
            "bad": tiny(seed + 100, layers=1),
            "perfect": target,
            "truncated": build_draft("truncate:2", target),
        }
        out[seed] = (target, drafts, [(p, hf_greedy(target, p, N_NEW)) for p in prompts])
    return out


@pytest.mark.parametrize("seed", sorted(PROMPTS))
@pytest.mark.parametrize("draft_kind", ["bad", "perfect", "truncated"])
def test_greedy_output_equals_target_greedy(greedy_targets, seed, draft_kind):
    target, drafts, refs = greedy_targets[seed]
    draft = drafts[draft_kind]
    params = GenerationParams(max_new_tokens=N_NEW, capture=False)
    rates = []
    for k, conf, adaptive in itertools.product((1, 2, 4, 7), (0.0, 0.3, 0.9), (True, False)):
        eng = SpecEngine(target, draft, options=small_options(k=k, draft_confidence=conf, k_policy="schedule" if adaptive else "fixed",
                                                              max_seq_len=64))
        for prompt, ref in refs:
            r = eng.generate(prompt, params)
            assert r.output_ids == ref, (k, conf, adaptive, prompt)
            assert r.finish_reason == "length"
            assert r.stats.num_drafts > 0
            rates.append(r.stats.acceptance_rate)
            if draft_kind == "perfect":
                assert r.stats.acceptance_rate == 1.0
                if conf == 0.0:  # every step drafts min(k, remaining - 1) and keeps all of them
                    assert r.stats.num_steps == -(-N_NEW // (k + 1))
    if draft_kind == "bad":
        assert max(rates) < 0.5  # the bad draft is really rejected, so the rollback path ran


def test_adaptive_k_shrinks_for_a_bad_draft_and_holds_for_a_perfect_one(greedy_targets):
    target, drafts, refs = greedy_targets[sorted(PROMPTS)[0]]
    prompt = refs[0][0]
    params = GenerationParams(max_new_tokens=N_NEW, capture=False)
    k = 6

    def stats(draft, adaptive):
        eng = SpecEngine(target, draft, options=small_options(k=k, k_policy="schedule" if adaptive else "fixed", max_seq_len=64))
        return eng.generate(prompt, params).stats

    fixed, adaptive = stats(drafts["bad"], False), stats(drafts["bad"], True)
    # Fixed k drafts k per step until the budget cap; adaptive falls towards 1 per step.
    assert fixed.num_draft_tokens / fixed.num_drafts > 3
    assert adaptive.num_draft_tokens / adaptive.num_drafts < 2
    assert adaptive.num_draft_tokens < fixed.num_draft_tokens
    perfect = stats(drafts["perfect"], True)
    assert perfect.num_accepted_tokens == perfect.num_draft_tokens
    assert perfect.num_steps == -(-N_NEW // (k + 1))  # never shrank below k


@pytest.mark.parametrize("seed", sorted(PROMPTS))
def test_autoregressive_equals_target_greedy(greedy_targets, seed):
    target, drafts, refs = greedy_targets[seed]
    no_draft = SpecEngine(target, options=small_options(max_seq_len=64))
    with_draft = SpecEngine(target, drafts["bad"], options=small_options(k=4, max_seq_len=64))
    for prompt, ref in refs:
        a = no_draft.generate(prompt, GenerationParams(max_new_tokens=N_NEW))
        b = with_draft.generate(prompt, GenerationParams(max_new_tokens=N_NEW, speculate=False))
        for r in (a, b):
            assert r.output_ids == ref
            assert r.stats.num_drafts == 0 and r.stats.num_draft_tokens == 0
            assert r.stats.num_steps == N_NEW and r.stats.mean_accepted_len == 1.0
            assert r.stats.acceptance_rate == 0.0


def test_hf_runner_engine_equals_target_greedy(greedy_targets, monkeypatch):
    """The generic runner (DynamicCache + crop) through the same loop, with rejections."""
    import serve.engine.core

    target, drafts, refs = greedy_targets[0]
    def hf(model, max_seq_len, quant="none", cpu_kernels="auto"):
        return HFRunner(model, max_seq_len)

    monkeypatch.setattr(serve.engine.core, "make_runner", hf)
    monkeypatch.setattr(serve.engine.core, "draft_runner", hf)
    eng = SpecEngine(target, drafts["bad"], options=small_options(k=3, max_seq_len=64, max_concurrency=1))
    assert isinstance(eng.target, HFRunner) and isinstance(eng.draft.runner, HFRunner)
    prompt, ref = refs[0]
    r = eng.generate(prompt, GenerationParams(max_new_tokens=N_NEW))
    assert r.output_ids == ref
    assert 0 < r.stats.num_draft_tokens - r.stats.num_accepted_tokens
    cache = only_slot(eng).target
    assert cache.length == cache.kv.get_seq_length() == len(prompt) + N_NEW - 1


# ---------------------------------------------------------------- sampling losslessness

V8 = dict(vocab_size=8, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32)
SAMPLE_PROMPT = [1, 2, 3]
N_SAMPLES = 2000


@pytest.fixture(scope="module")
def v8():
    target = tiny(3, layers=2, **V8)
    bad = tiny(3, layers=2, **V8)
    with torch.no_grad():
        # q is proportional to p ** -0.5: the draft prefers what the target finds unlikely.
        bad.lm_head.weight.mul_(-0.5)
    return {"target": target, "normal": build_draft("truncate:1", target), "bad": bad}


def exact_first_two(target, prompt, sp: SamplingParams) -> torch.Tensor:
    """P(t1, t2) = p(t1 | prompt) p(t2 | prompt, t1) from full forwards, warped like the engine."""
    v = target.config.vocab_size
    with torch.no_grad():
        p1 = warp_probs(target(torch.tensor([prompt])).logits[0, -1], sp)
        p2 = warp_probs(target(torch.tensor([prompt + [t] for t in range(v)])).logits[:, -1], sp)
    return p1[:, None] * p2


@pytest.mark.parametrize(
    "draft_kind, sampling, conf",
    [
        ("normal", SamplingParams(temperature=1.0), 0.5),
        ("bad", SamplingParams(temperature=1.0), 0.0),
        ("normal", SamplingParams(temperature=0.8, top_k=6, top_p=0.9), 0.4),
    ],
)
def test_sampled_first_two_tokens_follow_target(v8, draft_kind, sampling, conf):
    target = v8["target"]
    k = 2  # max_new_tokens = k + 1 drafts both of the first two positions in the first step
    eng = SpecEngine(target, v8[draft_kind], options=small_options(k=k, draft_confidence=conf, max_seq_len=32))
    counts = torch.zeros(8, 8, dtype=torch.long)
    drafted = accepted = drafts = 0
    for i in range(N_SAMPLES):
        sp = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed=i)
        r = eng.generate(SAMPLE_PROMPT, GenerationParams(max_new_tokens=k + 1, sampling=sp, capture=False))
        counts[r.output_ids[0], r.output_ids[1]] += 1
        drafted += r.stats.num_draft_tokens
        accepted += r.stats.num_accepted_tokens
        drafts += r.stats.num_drafts
    rate = accepted / drafted
    # Both the accept path and the residual (rejection) path ran many times.
    assert 0.05 < rate < 0.9, rate
    assert drafted - accepted > 300
    if conf:
        assert drafted < k * drafts  # the confidence stop cut some steps short
    exact = exact_first_two(target, SAMPLE_PROMPT, sampling)
    assert chi2_pvalue(counts, exact) > 1e-3


def test_sampling_is_reproducible_with_a_seed(v8):
    eng = SpecEngine(v8["target"], v8["normal"], options=small_options(k=3, max_seq_len=32))
    params = GenerationParams(max_new_tokens=20, sampling=SamplingParams(temperature=1.0, seed=7))
    a, b = eng.generate(SAMPLE_PROMPT, params), eng.generate(SAMPLE_PROMPT, params)
    assert a.output_ids == b.output_ids
    other = GenerationParams(max_new_tokens=20, sampling=SamplingParams(temperature=1.0, seed=8))
    assert eng.generate(SAMPLE_PROMPT, other).output_ids != a.output_ids


# ---------------------------------------------------------------- KV rollback


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=3)])
def test_kv_cache_after_partial_acceptance_equals_fresh_prefill(greedy_targets, sampling):
    target = greedy_targets[1][0]
    eng = SpecEngine(target, build_draft("truncate:3", target), options=small_options(k=4, max_seq_len=64, max_concurrency=1))
    prompt = [5, 9, 13]
    r = eng.generate(prompt, GenerationParams(max_new_tokens=40, sampling=sampling, capture=False))
    st = r.stats
    # Partial acceptances happened: steps that accepted one or more drafts but not all k.
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert st.accepted_per_pos[1] > 0 and st.accepted_per_pos[0] > st.accepted_per_pos[-1]
    tokens = prompt + r.output_ids
    slot = only_slot(eng)
    dcache = slot.draft_cache(eng.draft)
    for runner, cache in ((eng.target, slot.target), (eng.draft.runner, dcache)):
        n = cache.length
        fresh = runner.new_cache()
        runner.forward(torch.tensor(tokens[:n]), fresh)
        assert torch.allclose(cache.k[:, :, :n], fresh.k[:, :, :n], atol=1e-5, rtol=1e-5)
        assert torch.allclose(cache.v[:, :, :n], fresh.v[:, :, :n], atol=1e-5, rtol=1e-5)
    assert slot.target.length == len(tokens) - 1
    assert dcache.length <= len(tokens) - 1


def test_static_cache_truncate_bounds():
    c = StaticKVCache(2, 1, 8, 4, torch.float32, torch.device("cpu"))
    c.length = 5
    for bad in (-1, 6, 100):
        with pytest.raises(ValueError, match="cannot truncate"):
            c.truncate(bad)
    assert c.length == 5
    c.truncate(5)
    c.truncate(2)
    assert c.length == 2
    c.truncate(0)
    assert c.length == 0


# ---------------------------------------------------------------- capture


@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SamplingParams(temperature=0.5, top_k=5, seed=1)], ids=["greedy", "sampled"]
)
def test_capture_matches_target_and_stats(greedy_targets, sampling):
    target, drafts, _ = greedy_targets[1]
    draft = drafts["truncated"]
    K = 8
    eng = SpecEngine(target, draft, options=small_options(k=4, draft_confidence=0.3, capture_top_k=K, max_seq_len=64))
    prompt = [11, 22, 33, 44]
    r = eng.generate(prompt, GenerationParams(max_new_tokens=30, sampling=sampling))
    cap, st, n = r.capture, r.stats, len(r.output_ids)
    assert len(cap) == n == 30
    assert cap.tokens.tolist() == r.output_ids
    # Raw (temperature 1, unfiltered) target distribution at each generated position.
    rows = slice(len(prompt) - 1, len(prompt) - 1 + n)
    logits = full_logits(target, prompt + r.output_ids)[rows]
    ref_lp, ref_ids = torch.topk(torch.log_softmax(logits, -1), K, dim=-1)
    assert cap.topk_ids.shape == (n, K) and cap.topk_logprobs.dtype == np.float16
    np.testing.assert_array_equal(cap.topk_ids, ref_ids.numpy())
    np.testing.assert_allclose(cap.topk_logprobs.astype(np.float32), ref_lp.numpy(), atol=2e-3, rtol=1e-3)
    # Flags agree with the counters; each step leaves exactly one non-accepted row.
    assert int(cap.accepted.sum()) == st.num_accepted_tokens
    assert int((~cap.accepted).sum()) == st.num_steps
    none = cap.draft_tokens == -1
    np.testing.assert_array_equal(none, np.isnan(cap.draft_probs))
    assert none.any() and (~none).any()
    assert (cap.draft_tokens[cap.accepted] == cap.tokens[cap.accepted]).all()
    assert not cap.accepted[none].any()
    assert ((cap.draft_probs[~none] > 0) & (cap.draft_probs[~none] <= 1)).all()
    rejected = ~none & ~cap.accepted
    assert rejected.any()
    if sampling.greedy:
        # The draft's proposal at each row is its argmax given the committed prefix, and the
        # probability recorded is its own softmax probability there.
        dl = torch.softmax(full_logits(draft, prompt + r.output_ids)[rows], -1)
        idx = np.nonzero(~none)[0]
        assert (cap.draft_tokens[idx] == dl[idx].argmax(-1).numpy()).all()
        np.testing.assert_allclose(cap.draft_probs[idx], dl[idx].max(-1).values.numpy(), atol=1e-5)
        assert (cap.draft_tokens[rejected] != cap.tokens[rejected]).all()


def test_capture_autoregressive_rows_have_no_draft(greedy_targets):
    target, _, _ = greedy_targets[0]
    r = SpecEngine(target, options=small_options(max_seq_len=64, capture_top_k=4)).generate(
        [3, 4], GenerationParams(max_new_tokens=6)
    )
    cap = r.capture
    assert cap.topk_ids.shape == (6, 4)
    assert (cap.draft_tokens == -1).all() and np.isnan(cap.draft_probs).all() and not cap.accepted.any()
    assert (cap.topk_ids[:, 0] == cap.tokens).all()  # greedy: the emitted token is the top-1


def test_capture_off(greedy_targets):
    target, drafts, _ = greedy_targets[0]
    on = SpecEngine(target, drafts["bad"], options=small_options(k=2, max_seq_len=64))
    off = SpecEngine(target, drafts["bad"], options=small_options(k=2, max_seq_len=64, capture=False))
    assert on.generate([1, 2], GenerationParams(max_new_tokens=5, capture=False)).capture is None
    assert off.generate([1, 2], GenerationParams(max_new_tokens=5)).capture is None
    assert on.generate([1, 2], GenerationParams(max_new_tokens=5)).capture is not None


# ---------------------------------------------------------------- interface


@pytest.fixture(scope="module")
def with_tok():
    model = build_tiny_llama(seed=0, max_positions=128)  # EOS on, from the tokenizer
    return model, tiny_tokenizer()


@pytest.mark.parametrize("k", [0, 4, 7])
def test_eos_stops_with_reason_stop(with_tok, k):
    model, tok = with_tok
    prompt = tok.encode("abc def", add_special_tokens=False)
    ref = hf_greedy(model, prompt, 40, eos=True)
    assert ref[-1] == tok.eos_token_id and len(ref) < 40  # this prompt reaches EOS
    eng = SpecEngine(model, model if k else None, tokenizer=tok, options=small_options(k=max(k, 1), max_seq_len=128))
    r = eng.generate(prompt, GenerationParams(max_new_tokens=40))
    assert r.finish_reason == "stop"
    assert r.output_ids == ref
    assert len(r.capture) == len(ref) and r.capture.tokens[-1] == tok.eos_token_id
    assert "<|im_end|>" not in r.text


def test_max_new_tokens_reason_length(greedy_targets):
    target, _, refs = greedy_targets[0]
    eng = SpecEngine(target, target, options=small_options(k=4, max_seq_len=64))
    prompt, ref = refs[0]
    for n in (1, 2, 5, 7):
        r = eng.generate(prompt, GenerationParams(max_new_tokens=n))
        assert r.finish_reason == "length"
        assert r.output_ids == ref[:n]
        # The same prompt again: its slot holds all of it but the last token (serve/engine/prefix.py).
        cached = 0 if n == 1 else len(prompt) - 1
        assert r.usage == {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n,
                           "prompt_tokens_details": {"cached_tokens": cached}}


def test_stop_string(with_tok):
    model, tok = with_tok
    prompt = tok.encode("Hello", add_special_tokens=False)
    eng = SpecEngine(model, model, tokenizer=tok, options=small_options(k=4, max_seq_len=128))
    full = eng.generate(prompt, GenerationParams(max_new_tokens=30))
    stop = "u23"
    cut = full.text.find(stop)
    assert cut > 0 and full.finish_reason == "length"
    r = eng.generate(prompt, GenerationParams(max_new_tokens=30, stop=("zzz", stop)))
    assert r.finish_reason == "stop"
    assert stop not in r.text
    assert r.text == full.text[:cut]
    assert len(r.output_ids) < 30 and r.output_ids == full.output_ids[: len(r.output_ids)]


def _collect(stream):
    async def run():
        chunks = [c async for c in stream]
        return chunks, stream.result

    return run


def test_stream_concatenates_to_result(greedy_targets):
    target, drafts, refs = greedy_targets[0]
    eng = SpecEngine(target, drafts["truncated"], options=small_options(k=3, max_seq_len=64))
    prompt, ref = refs[0]
    chunks, result = asyncio.run(_collect(eng.stream(prompt, GenerationParams(max_new_tokens=N_NEW)))())
    assert [t for c in chunks for t in c] == result.output_ids == ref
    assert all(1 <= len(c) <= 4 for c in chunks)
    assert len(chunks) == result.stats.num_steps


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=5)])
def test_concurrent_streams_keep_separate_state(greedy_targets, sampling):
    target, drafts, _ = greedy_targets[0]
    eng = SpecEngine(target, drafts["bad"], options=small_options(k=3, max_seq_len=64, max_concurrency=2))
    pa, pb = [7, 8, 9, 10], [200, 100]
    params = GenerationParams(max_new_tokens=20, sampling=sampling)
    seq_a, seq_b = eng.generate(pa, params), eng.generate(pb, params)
    assert seq_a.output_ids != seq_b.output_ids

    async def both():
        return await asyncio.gather(_collect(eng.stream(pa, params))(), _collect(eng.stream(pb, params))())

    (ca, ra), (cb, rb) = asyncio.run(both())
    assert [t for c in ca for t in c] == ra.output_ids == seq_a.output_ids
    assert [t for c in cb for t in c] == rb.output_ids == seq_b.output_ids


def test_vocab_mismatch_is_refused():
    with pytest.raises(EngineError, match="vocab"):
        SpecEngine(tiny(0), tiny(1, vocab_size=300), options=small_options(max_seq_len=64))
    with pytest.raises(EngineError, match="tokenizer"):
        SpecEngine(tiny(0, vocab_size=100), tokenizer=tiny_tokenizer(), options=small_options(max_seq_len=64))


def test_engine_options_validation():
    for bad in (dict(k=-1), dict(draft_confidence=1.0), dict(draft_confidence=-0.1), dict(capture_top_k=0),
                dict(max_concurrency=0), dict(max_seq_len=1)):
        with pytest.raises(EngineError):
            small_options(**bad)
    with pytest.raises(EngineError, match="prefill_chunk"):
        small_options(prefill_chunk=0)


def test_bad_requests_raise_at_the_call(greedy_targets):
    target, drafts, _ = greedy_targets[0]
    eng = SpecEngine(target, drafts["bad"], options=small_options(k=2, max_seq_len=32))
    assert eng.max_seq_len == 32
    cases = [
        ([1] * 20, GenerationParams(max_new_tokens=13), "exceeds the context"),
        ([], GenerationParams(), "empty"),
        ([1, -1], GenerationParams(max_new_tokens=4), "outside the vocab"),
        ([1, 259], GenerationParams(max_new_tokens=4), "outside the vocab"),
        ([1, 2], GenerationParams(max_new_tokens=0), "max_new_tokens"),
    ]
    for prompt, params, msg in cases:
        with pytest.raises(RequestError, match=msg):
            eng.generate(prompt, params)
        with pytest.raises(RequestError, match=msg):
            eng.stream(prompt, params)  # before any iteration
    # Exactly at the context limit is fine.
    r = eng.generate([1] * 20, GenerationParams(max_new_tokens=12))
    assert len(r.output_ids) == 12
    # A failed call leaves the engine usable (slots returned).
    assert eng.generate([1, 2], GenerationParams(max_new_tokens=3)).finish_reason == "length"


def test_spec_stats_counters(greedy_targets):
    target, drafts, _ = greedy_targets[1]
    eng = SpecEngine(target, drafts["truncated"], options=small_options(k=4, draft_confidence=0.3, max_seq_len=64))
    r = eng.generate([9, 8, 7], GenerationParams(max_new_tokens=30))
    st = r.stats
    assert len(st.accepted_per_pos) == 4
    assert sum(st.accepted_per_pos) == st.num_accepted_tokens
    assert all(a >= b for a, b in zip(st.accepted_per_pos, st.accepted_per_pos[1:]))
    assert st.accepted_per_pos[0] <= st.num_drafts <= st.num_steps
    assert st.num_drafts <= st.num_draft_tokens <= 4 * st.num_drafts
    assert st.num_emitted_tokens == len(r.output_ids) == st.num_accepted_tokens + st.num_steps
    assert st.mean_accepted_len == pytest.approx(len(r.output_ids) / st.num_steps)
    assert st.acceptance_rate == pytest.approx(st.num_accepted_tokens / st.num_draft_tokens)
    assert 1.0 < st.mean_accepted_len < 5.0


# ---------------------------------------------------------------- drafts


def test_build_draft_specs(greedy_targets):
    target, _, _ = greedy_targets[0]
    for spec in (None, "", "none"):
        assert build_draft(spec, target) is None
    assert build_draft("self", target) is target
    for bad, msg in [("truncate:0", "1..4"), ("truncate:5", "1..4"), ("truncate:x", "integer"),
                     ("truncate:", "integer"), ("bogus", "unknown draft spec")]:
        with pytest.raises(DraftSpecError, match=msg):
            build_draft(bad, target)
    assert issubclass(DraftSpecError, ValueError)


def test_truncated_draft_is_first_layers_sharing_tensors(greedy_targets):
    from transformers import LlamaForCausalLM

    target, _, _ = greedy_targets[0]
    draft = build_draft("truncate:2", target)
    assert draft.config.num_hidden_layers == 2 and len(draft.model.layers) == 2
    assert target.config.num_hidden_layers == 4 and len(target.model.layers) == 4
    tp = dict(target.named_parameters())
    for name, param in draft.named_parameters():
        assert param.data_ptr() == tp[name].data_ptr(), name
    # Same logits as a model built by hand from the first two layers.
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = 2
    hand = LlamaForCausalLM(cfg).eval()
    hand.load_state_dict({k: v for k, v in target.state_dict().items()
                          if not k.startswith(("model.layers.2.", "model.layers.3."))})
    ids = [4, 8, 15, 16, 23, 42]
    assert torch.allclose(full_logits(draft, ids), full_logits(hand, ids), atol=1e-6)
    assert not torch.allclose(full_logits(draft, ids), full_logits(target, ids), atol=1e-2)


# ---------------------------------------------------------------- runners


@pytest.mark.parametrize("runner_cls", [LlamaRunner, HFRunner])
def test_runner_logits_match_hf_forward(greedy_targets, runner_cls):
    target, _, _ = greedy_targets[1]
    runner = runner_cls(target, max_seq_len=64)
    cache = runner.new_cache()
    seq = [5, 77, 3, 120, 9, 250]
    out = [runner.forward(torch.tensor(seq), cache)]
    for t in (31, 64, 2, 199):  # single-token steps
        seq.append(t)
        out.append(runner.forward(torch.tensor([t]), cache))
    seq += [8, 7, 6]  # a multi-token block on top of the cache (a scoring step)
    out.append(runner.forward(torch.tensor([8, 7, 6]), cache))
    assert cache.length == len(seq)
    got = torch.cat(out)
    assert got.shape == (len(seq), target.config.vocab_size) and got.dtype == torch.float32
    assert torch.allclose(got, full_logits(target, seq), atol=1e-4)
    # Roll back past the block and continue with other tokens: stale slots must not leak.
    cache.truncate(8)
    seq = seq[:8] + [100, 101]
    tail = runner.forward(torch.tensor([100, 101]), cache)
    assert torch.allclose(tail, full_logits(target, seq)[8:], atol=1e-4)
    with pytest.raises(ValueError, match="exceeds"):
        runner.forward(torch.zeros(64, dtype=torch.long), cache)


def test_make_runner_picks_by_model_type(greedy_targets):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

    target, _, _ = greedy_targets[0]
    assert isinstance(make_runner(target, 64), LlamaRunner)
    assert make_runner(target, 64).max_seq_len == 64
    cfg = copy.deepcopy(target.config)
    cfg.attention_bias = True  # biases are a family difference the lean runner takes
    assert isinstance(make_runner(LlamaForCausalLM(cfg), 64), LlamaRunner)
    cfg.mlp_bias = True  # an MLP with biases is not: the generic runner takes it
    assert isinstance(make_runner(LlamaForCausalLM(cfg), 64), HFRunner)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=259, n_positions=64, n_embd=32, n_layer=1, n_head=2)).eval()
    assert isinstance(make_runner(gpt2), HFRunner)
    with pytest.raises(TypeError, match="model_type 'gpt2': the lean forward runs llama"):
        LlamaRunner(gpt2)


def test_engine_pairs_a_non_llama_target_with_a_llama_draft():
    """Any two causal LMs sharing a vocab: a GPT-2 target (HFRunner) with a Llama draft."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=259, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                      eos_token_id=None, bos_token_id=None)).eval()
    with torch.no_grad():
        gpt2.lm_head.weight.mul_(20)  # tied to the embedding; widens logits so there are no near-ties
    gpt2.generation_config.eos_token_id = None
    eng = SpecEngine(gpt2, tiny(5, layers=1), options=small_options(k=3, max_seq_len=64))
    assert isinstance(eng.target, HFRunner) and isinstance(eng.draft.runner, LlamaRunner)
    prompt = [10, 20, 30]
    r = eng.generate(prompt, GenerationParams(max_new_tokens=16))
    assert r.output_ids == hf_greedy(gpt2, prompt, 16)
    assert r.stats.num_draft_tokens > r.stats.num_accepted_tokens


def test_per_request_draft_is_lossless_and_shares_the_slot_cache(greedy_targets):
    """A request may name its own draft (hot swap): output unchanged, one cache per draft shape."""
    target = greedy_targets[1][0]
    eng = SpecEngine(target, build_draft("truncate:1", target), options=small_options(k=3, max_seq_len=64, max_concurrency=1))
    other = eng.make_draft(build_draft("truncate:1", target))  # same shape, different object
    deeper = eng.make_draft(build_draft("truncate:2", target))
    prompt, params = [3, 7, 11], GenerationParams(max_new_tokens=20, capture=False)
    want = eng.generate(prompt, params, draft=None).output_ids  # autoregressive
    for d in (other, deeper, eng.draft):
        r = eng.generate(prompt, params, draft=d)
        assert r.output_ids == want and r.stats.num_draft_tokens > 0
    slot = only_slot(eng)
    assert len(slot.drafts) == 2  # 1-layer drafts share one cache; the 2-layer one has its own
    assert eng.generate(prompt, params, draft=None).stats.num_draft_tokens == 0


def test_a_draft_with_a_shorter_context_is_refused_for_hot_swap(greedy_targets):
    target = greedy_targets[1][0]
    eng = SpecEngine(target, None, options=small_options(k=2, max_seq_len=64, max_concurrency=1))
    short = build_draft("truncate:1", target)
    short.config.max_position_embeddings = 32
    with pytest.raises(EngineError, match="shorter than the engine's"):
        eng.make_draft(short)
