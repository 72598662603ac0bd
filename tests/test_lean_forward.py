"""The lean forward (serve/model/runner.py LlamaRunner) against Hugging Face's, in float32 and
bfloat16; its int4 weights (serve/model/linear.py) against the weights they encode; and sampling
stays exact in bfloat16, for chains and trees (chi-square)."""

import pytest
import torch
from chi2 import chi2_pvalue, sample_first_two

from infra.target import build_tiny_llama
from serve.spec_decode.specs import build_draft
from serve.engine.core import EngineError, GenerationParams, SpecEngine
from engine_options import small_options
from serve.model.linear import Dense, Int4, Int8, dequantize_int4, int4_codes, make_linear
from serve.model.runner import LlamaRunner
from serve.model.factory import make_runner
from serve.spec_decode.factory import draft_runner
from serve.sampling.verify import SamplingParams, warp_probs

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]

# Widths that are multiples of int4's group of 32, a grouped-query attention, and 3 layers.
SHAPE = dict(vocab_size=300, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)


def tiny(seed=0, dtype="float32", layers=3, **kw):
    m = build_tiny_llama(seed=seed, num_layers=layers, max_positions=128, dtype=dtype, **{**SHAPE, **kw})
    m.config.eos_token_id = None
    return m


def hf_logits(model, prefix, block):
    with torch.no_grad():
        return model(torch.tensor([prefix + block])).logits[0, len(prefix):].float()


def lean_logits(runner, prefix, block):
    cache = runner.new_cache()
    if prefix:
        runner.forward(torch.tensor(prefix), cache)
    return runner.forward(torch.tensor(block), cache)


@pytest.mark.parametrize("t", [1, 5, 33])
@pytest.mark.parametrize("cached", [False, True])
def test_lean_logits_equal_hf_in_float32(t, cached):
    model = tiny(seed=1)
    gen = torch.Generator().manual_seed(t)
    prefix = torch.randint(0, 300, (9 if cached else 0,), generator=gen).tolist()
    block = torch.randint(0, 300, (t,), generator=gen).tolist()
    torch.testing.assert_close(lean_logits(LlamaRunner(model, 128), prefix, block), hf_logits(model, prefix, block),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("t", [1, 5, 33])
@pytest.mark.parametrize("cached", [False, True])
def test_lean_logits_equal_hf_in_bfloat16_to_its_rounding(t, cached):
    """bfloat16 rounds differently op by op, so both are held against float32 logits of the same
    weights: the lean forward's error is of the size of HF's own bfloat16 error."""
    model = tiny(seed=2, dtype="bfloat16")
    ref32 = tiny(seed=2, dtype="bfloat16").float()  # the same bf16 weights, computed in float32
    gen = torch.Generator().manual_seed(t)
    prefix = torch.randint(0, 300, (9 if cached else 0,), generator=gen).tolist()
    block = torch.randint(0, 300, (t,), generator=gen).tolist()
    exact = hf_logits(ref32, prefix, block)
    hf_err = (hf_logits(model, prefix, block) - exact).abs().max()
    lean_err = (lean_logits(LlamaRunner(model, 128), prefix, block) - exact).abs().max()
    scale = exact.abs().max()
    assert lean_err <= 2 * hf_err + 0.01 * scale, (float(lean_err), float(hf_err), float(scale))


def test_lean_features_are_the_layer_outputs_in_bfloat16():
    model = tiny(seed=3, dtype="bfloat16")
    ids = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(0))
    r = LlamaRunner(model, 128)
    _, feats = r.forward_features(ids, r.new_cache(), (0, 1))  # HF's last entry is after the norm
    with torch.no_grad():
        hs = model(ids.unsqueeze(0), output_hidden_states=True).hidden_states
    want = torch.cat([hs[1][0], hs[2][0]], dim=-1).float()
    assert (feats.float() - want).abs().max() <= 0.05 * want.abs().max()


def test_greedy_decoding_equals_hf_generate_in_float32():
    for seed in (0, 4):
        model = tiny(seed=seed, layers=4)
        prompt = [5, 17, 200, 3, 99]
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        eng = SpecEngine(model, options=small_options(k=0, max_seq_len=128))
        assert eng.generate(prompt, GenerationParams(max_new_tokens=32)).output_ids == out[0, len(prompt):].tolist()


def test_runners_over_one_model_share_their_fused_weights():
    model = tiny(seed=5)
    a, b = LlamaRunner(model, 128), LlamaRunner(model, 128)
    assert a.blocks[0][1] is b.blocks[0][1]  # q|k|v fused once
    draft = LlamaRunner(build_draft("truncate:1", model), 128)  # shares the target's layer tensors
    assert draft.blocks[0][4] is a.blocks[0][4]


# ---------------------------------------------------------------- int4


def q41_blocks(n, k, seed=0):
    """Weights as llama.cpp's Q4_1 writes them: per block of 32, fp16 d and m, codes 0..15 with
    the block's minimum at code 0 and maximum at code 15."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15
    d = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).half().float()
    m = (torch.randn(n, k // 32, generator=g) * 0.05).half().float()
    w = (codes * d.unsqueeze(-1) + m.unsqueeze(-1)).reshape(n, k)
    return w, codes.reshape(n, k).int(), d, m


def test_int4_codes_recover_q4_1_blocks_exactly():
    w, codes, d, m = q41_blocks(64, 128)
    got_codes, scale, lo = int4_codes(w)
    assert torch.equal(got_codes, codes)
    torch.testing.assert_close(scale, d, rtol=1e-6, atol=0)
    torch.testing.assert_close(lo, m, rtol=0, atol=0)
    torch.testing.assert_close(dequantize_int4(got_codes, scale, lo), w, rtol=0, atol=1e-6)


def test_int4_linear_multiplies_by_the_weights_it_encodes():
    w, *_ = q41_blocks(96, 64, seed=1)
    lin = Int4.from_weight(w, torch.bfloat16)
    x = torch.randn(5, 64).bfloat16()
    want = x.float() @ w.t()
    got = lin(x).float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    with pytest.raises(ValueError, match="multiple of the group"):
        Int4.from_weight(torch.randn(16, 40), torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):
        Int4.from_weight(torch.randn(150, 64), torch.bfloat16)
    # Where the kernel's tiles do not fit (a head draft's odd vocabulary), the weight stays dense.
    assert isinstance(make_linear(torch.randn(150, 64), "int4", torch.bfloat16), Dense)
    assert isinstance(make_linear(torch.randn(160, 64), "int4", torch.bfloat16), Int4)


def test_int8_head_is_close_to_its_weights():
    w = torch.randn(300, 64)
    x = torch.randn(3, 64).bfloat16()
    want = x.float() @ w.t()
    assert (Int8.from_weight(w, torch.bfloat16)(x).float() - want).abs().max() <= 0.03 * want.abs().max()


def dequantized(model):
    """A copy of `model` whose decoder linears hold their int4 round trip: the dense model an
    int4 runner is meant to compute."""
    out = tiny(seed=0, dtype="bfloat16")
    out.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in out.named_parameters():
            if name.startswith("model.layers.") and p.dim() == 2:
                p.copy_(dequantize_int4(*int4_codes(p)).to(p.dtype))
    return out


def test_int4_runner_computes_the_dequantized_model():
    model = tiny(seed=6, dtype="bfloat16")
    r4 = LlamaRunner(model, 128, quant="int4")
    dense = LlamaRunner(dequantized(model), 128)
    ids = torch.randint(0, 300, (14,), generator=torch.Generator().manual_seed(1))
    for prefix, block in ((ids[:0], ids[:7]), (ids[:7], ids[7:8]), (ids[:8], ids[8:13])):
        want, got = lean_logits(dense, prefix.tolist(), block.tolist()), lean_logits(r4, prefix.tolist(), block.tolist())
        # The head is int8 under int4: a few percent of the logits' range at most.
        assert (got - want).abs().max() <= 0.05 * want.abs().max()


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_bfloat16_speculation_equals_its_own_autoregression(quant):
    """int4: exactly (every kernel on its path rounds a row alike whatever the row count). Dense
    bfloat16: exactly here too, but on the real model oneDNN's bf16 GEMM rounds a row of a block
    differently now and then, so the docs (docs/engine.md) claim only near ties there."""
    model = tiny(seed=7, dtype="bfloat16", layers=4)
    prompt = [5, 17, 200, 3, 99]
    ar = SpecEngine(model, options=small_options(k=0, max_seq_len=128, quant=quant))
    sd = SpecEngine(model, build_draft("truncate:2", model),
                    options=small_options(k=3, max_seq_len=128, quant=quant, k_policy="fixed"))
    want = ar.generate(prompt, GenerationParams(max_new_tokens=40)).output_ids
    r = sd.generate(prompt, GenerationParams(max_new_tokens=40))
    assert r.stats.num_draft_tokens > 0
    assert r.output_ids == want  # a verify rounds as decode does: not even near ties differ


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_a_verify_block_rounds_exactly_as_one_row_decode_forwards_in_bfloat16(quant):
    """On these shapes both paths are bitwise row-independent; on the real model only int4 is
    always (osd bench engine checks greedy outputs against own AR there)."""
    model = tiny(seed=9, dtype="bfloat16")
    r = LlamaRunner(model, 128, quant=quant)
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(2))
    cache = r.new_cache()
    r.forward(ids[:20], cache)
    for t in (2, 5, 9, 16):
        block, feats = r.forward_features(ids[20:20 + t], cache, (0, 1))
        cache.truncate(20)
        rows = [r.forward_features(ids[20 + i:21 + i], cache, (0, 1)) for i in range(t)]
        cache.truncate(20)
        assert torch.equal(block, torch.cat([x[0] for x in rows])), t
        assert torch.equal(feats, torch.cat([x[1] for x in rows])), t


def test_where_bfloat16_is_emulated_a_verify_block_attends_each_row_as_its_decode_does(monkeypatch):
    """An AVX2-only CPU's path (infra/common/cpu.py): each row's probabilities times V over its own
    prefix. One bmm over the whole block rounded these rows otherwise than their one-row
    decodes on 2 Zen 3 cores (the contexts below are ones where it did)."""
    import serve.model.runner
    from serve.model.runner import attention

    monkeypatch.setattr(serve.model.runner, "native_bf16_gemm", lambda: False)
    t = 5
    for start in (40, 322, 363, 392, 500):
        gen = torch.Generator().manual_seed(start)
        end = start + t
        q = torch.randn(t, 9, 64, generator=gen).bfloat16()
        k, v = (torch.randn(3, end, 64, generator=gen).bfloat16() for _ in range(2))
        mask = torch.ones(end, end, dtype=torch.bool).tril()[start:end, :end]
        block = attention(q, k, v, mask, True)
        rows = [attention(q[j:j + 1], k[:, :start + j + 1], v[:, :start + j + 1], None, True) for j in range(t)]
        assert torch.equal(block, torch.cat(rows)), start


def test_a_head_beside_an_int4_target_keeps_int8_weights_close_to_its_own():
    """int4 codes of a one-layer head moved its greedy drafts off the float head's (docs/benchmarks.md,
    "The head's weights"); int8 keeps its logits within a small fraction of the float head's."""
    from infra.drafts.head import build_head
    from infra.drafts.spec import DraftSpec
    from serve.spec_decode.head.lean import LeanHead

    model = tiny(seed=8, dtype="bfloat16", layers=3)
    head = build_head(model, DraftSpec(family="head", feature_layers=(0, 1)), torch.arange(0, 288))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # a trained head's weights are not the target's copies
    runner = draft_runner(head, 128, quant="int4", cpu_kernels="torch")  # the native head: test_native_head.py
    assert runner.kernel.block[1].__class__.__name__ == "Int8"
    g = torch.randn(6, 64, dtype=torch.bfloat16)
    ids = torch.tensor([5, 17, 200, 3, 99, 7])
    mask = torch.ones(6, 6, dtype=torch.bool).tril()

    def logits(lean):
        return lean.rows(lean.fuse(torch.cat([g, g], -1)), ids, draft_runner(head, 128).new_cache(), 0, mask)[0].float()

    dense, int8, int4 = (logits(LeanHead(head, q)) for q in ("none", "int8", "int4"))
    err8, err4 = ((x - dense).abs().max() / dense.abs().max() for x in (int8, int4))
    assert err8 < 0.05 and err8 < err4 / 2, (err8, err4)


def test_a_head_drafts_for_an_int4_target_losslessly(monkeypatch):
    from infra.drafts.head import build_head
    from infra.drafts.spec import DraftSpec

    model = tiny(seed=8, dtype="bfloat16", layers=3)
    head = build_head(model, DraftSpec(family="head", feature_layers=(0, 1)), torch.arange(0, 300, 2))
    prompt = [5, 17, 200, 3, 99]
    monkeypatch.setenv("OSD_NATIVE_HEAD", "off")  # the head on PyTorch; the native head: test_native_head.py
    ar = SpecEngine(model, options=small_options(k=0, max_seq_len=128, quant="int4"))
    sd = SpecEngine(model, head, options=small_options(k=3, max_seq_len=128, quant="int4", k_policy="fixed"))
    assert sd.draft.kernel.block[1].__class__.__name__ == "Int8"  # beside int4, the head's q|k|v is int8
    want = ar.generate(prompt, GenerationParams(max_new_tokens=40)).output_ids
    r = sd.generate(prompt, GenerationParams(max_new_tokens=40))
    assert r.stats.num_draft_tokens > 0
    assert r.output_ids == want


def test_int4_is_refused_where_it_does_not_apply():
    with pytest.raises(ValueError, match="bfloat16"):
        LlamaRunner(tiny(seed=0), 128, quant="int4")  # float32
    with pytest.raises(ValueError, match="unknown quant"):
        LlamaRunner(tiny(seed=0, dtype="bfloat16"), 128, quant="int3")
    with pytest.raises(EngineError, match="quant"):
        small_options(quant="int3")
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(ValueError, match="lean forward runs"):
        make_runner(gpt2, 64, quant="int4")


def test_config_refuses_int4_outside_cpu_bfloat16():
    from infra.config import ModelConfig

    assert ModelConfig(dtype="bfloat16", quant="int4").quant == "int4"
    with pytest.raises(ValueError, match="bfloat16"):
        ModelConfig(dtype="float32", quant="int4")
    with pytest.raises(ValueError, match="device cpu"):
        ModelConfig(dtype="bfloat16", quant="int4", device="cuda")


def test_auto_takes_int4_for_the_gguf_target_on_cpu_only():
    from infra.config import ModelConfig

    def concrete(**kw):
        r = ModelConfig(**kw).resolved()
        return r.dtype, r.quant

    assert concrete() == ("bfloat16", "int4")  # the default target ships as Q4_1
    assert concrete(device="cuda") == ("float32", "none")
    assert concrete(target="tiny-random") == ("float32", "none")  # no 4-bit weights of its own
    assert concrete(target="tiny-random", quant="int4") == ("bfloat16", "int4")
    assert concrete(dtype="float32") == ("float32", "none")
    assert concrete(dtype="bfloat16", quant="none") == ("bfloat16", "none")
    assert ModelConfig().resolved("tiny-random").quant == "none"  # resolved for the target named


# ---------------------------------------------------------------- bf16 sampling stays exact

V8 = dict(vocab_size=8, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64)
N_SAMPLES = 2000


def _exact_first_two(target, prompt, sp):
    """P(t1, t2) from the bf16 target's own one-row-at-a-time forwards, warped like the engine."""
    runner = LlamaRunner(target, 32)

    def last(ids):
        return runner.forward(torch.tensor(ids), runner.new_cache())[-1]

    p1 = warp_probs(last(prompt), sp)
    p2 = torch.stack([warp_probs(last(prompt + [t]), sp) for t in range(8)])
    return p1[:, None] * p2


@pytest.mark.parametrize("tree", ["", "6,2,2"])
def test_sampling_in_bfloat16_follows_the_targets_distribution(tree):
    target = build_tiny_llama(seed=3, num_layers=2, max_positions=32, dtype="bfloat16", **V8)
    target.config.eos_token_id = None
    draft = build_draft("truncate:1", target)
    eng = SpecEngine(target, draft, options=small_options(k=2, max_seq_len=32, tree=tree, k_policy="fixed"))
    sampling = SamplingParams(temperature=0.9, top_p=0.95)
    counts, drafted, accepted = sample_first_two(eng, [1, 2, 3], sampling, N_SAMPLES)
    assert drafted - accepted > 200 and accepted > 200  # both the accept and the residual paths ran
    assert chi2_pvalue(counts, _exact_first_two(target, [1, 2, 3], sampling)) > 1e-3


def test_prefill_fills_the_cache_as_a_forward_does_without_logits():
    model = tiny(seed=10)
    r = LlamaRunner(model, 128)
    ids = torch.randint(0, 300, (30,), generator=torch.Generator().manual_seed(3))
    a, b = r.new_cache(), r.new_cache()
    feats = r.prefill(ids[:29], a, (0, 1))
    _, want = r.forward_features(ids[:29], b, (0, 1))
    assert torch.equal(feats, want) and a.length == b.length == 29
    assert r.prefill(ids[:29], r.new_cache()) is None  # no layers asked for: nothing returned
    torch.testing.assert_close(r.forward(ids[29:], a), r.forward(ids[29:], b), rtol=0, atol=0)


def test_an_int4_target_prefills_long_prompts_with_its_bfloat16_weights():
    model = tiny(seed=11, dtype="bfloat16")
    r4 = LlamaRunner(model, 128, quant="int4")
    assert r4.prefill_blocks is not r4.blocks and LlamaRunner(model, 128).prefill_blocks is not None
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(4))
    dense = LlamaRunner(model, 128)
    a, b = r4.new_cache(), dense.new_cache()
    r4.prefill(ids[:30], a)
    dense.prefill(ids[:30], b)
    assert torch.equal(a.k[:, :, :30], b.k[:, :, :30])  # the prompt's K/V: the bf16 model's
    # Speculation over such a prompt still equals the int4 target's own decoding.
    prompt = ids[:30].tolist()
    ar = SpecEngine(model, options=small_options(k=0, max_seq_len=128, quant="int4"))
    sd = SpecEngine(model, build_draft("truncate:1", model),
                    options=small_options(k=3, max_seq_len=128, quant="int4", k_policy="fixed"))
    want = ar.generate(prompt, GenerationParams(max_new_tokens=24)).output_ids
    assert sd.generate(prompt, GenerationParams(max_new_tokens=24)).output_ids == want
