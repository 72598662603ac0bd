"""The lean forward (serve/model/runner.py) and the native one for every family of
serve/model/families.py, against Hugging Face's forward of the same weights: logits in
float32 for T = 1, 5 and 33 with and without a cache, Llama 3 rope scaling past the original
context, a batched step equal to each sequence alone, and greedy speculation equal to AR."""

import pytest
import torch
from test_lean_forward import hf_logits, lean_logits

from infra.target import build_tiny
from serve.spec_decode.specs import build_draft
from serve.engine.core import GenerationParams, SpecEngine
from engine_options import small_options
from serve.model.families import UnsupportedModel, lean_family
from serve.model.runner import HFRunner, LlamaRunner
from serve.model.factory import make_runner

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]

SHAPE = dict(vocab_size=300, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128,
             max_positions=128, num_layers=3)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# (family, config overrides): every way the lean forward differs from plain Llama.
VARIANTS = {
    "llama-bias": ("llama", dict(attention_bias=True)),
    "llama3-rope": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
    "llama-linear-rope": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                         "factor": 4.0})),
    "mistral": ("mistral", dict(sliding_window=None)),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", dict(head_dim=32)),
}


def tiny(variant, seed=0, dtype="float32", **kw):
    family, extra = VARIANTS[variant]
    m = build_tiny(family, seed=seed, dtype=dtype, **{**SHAPE, **extra, **kw})
    m.config.eos_token_id = None
    return m


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("t", [1, 5, 33])
@pytest.mark.parametrize("cached", [False, True])
def test_lean_logits_equal_hf_in_float32(variant, t, cached):
    model = tiny(variant, seed=1)
    gen = torch.Generator().manual_seed(t)
    # Long enough past the cache that llama3's scaled frequencies (original context 16) matter.
    prefix = torch.randint(0, 300, (40 if cached else 0,), generator=gen).tolist()
    block = torch.randint(0, 300, (t,), generator=gen).tolist()
    got = lean_logits(LlamaRunner(model, 128), prefix, block)
    torch.testing.assert_close(got, hf_logits(model, prefix, block), rtol=1e-4, atol=1e-4)


def test_llama3_rope_scaling_changes_the_logits_past_the_original_context():
    """The check above would pass for a forward that ignored the scaling only if the scaling did
    nothing here: it does."""
    scaled, plain = tiny("llama3-rope", seed=2), build_tiny("llama", seed=2, **SHAPE)
    plain.load_state_dict(scaled.state_dict())
    ids = torch.randint(0, 300, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    assert (hf_logits(scaled, ids[:50], ids[50:]) - hf_logits(plain, ids[:50], ids[50:])).abs().max() > 1e-2


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bfloat16_lean_logits_stay_near_float32(variant):
    model = tiny(variant, seed=3, dtype="bfloat16")
    ref = tiny(variant, seed=3, dtype="bfloat16").float()
    ids = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    exact = hf_logits(ref, ids[:7], ids[7:])
    hf_err = (hf_logits(model, ids[:7], ids[7:]) - exact).abs().max()
    lean_err = (lean_logits(LlamaRunner(model, 128), ids[:7], ids[7:]) - exact).abs().max()
    assert lean_err <= 2 * hf_err + 0.01 * exact.abs().max()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_speculation_equals_autoregression(variant):
    model = tiny(variant, seed=4)
    prompt = [5, 17, 200, 3, 99]
    ar = SpecEngine(model, options=small_options(k=0, max_seq_len=128))
    want = ar.generate(prompt, GenerationParams(max_new_tokens=24)).output_ids
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                            attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert want == hf[0, len(prompt):].tolist()
    for name in ("truncate:1", "suffix", "head:untrained"):
        spec = SpecEngine(model, build_draft(name, model), options=small_options(k=3, max_seq_len=128))
        assert spec.generate(prompt, GenerationParams(max_new_tokens=24)).output_ids == want, name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batched_rows_equal_each_sequence_alone(variant):
    model = tiny(variant, seed=5, dtype="bfloat16")
    eng = SpecEngine(model, build_draft("suffix", model), options=small_options(k=2, max_seq_len=128, quant="int4", max_concurrency=4))
    prompts = [[5, 17, 200], [9, 8, 7, 6, 5], [100, 3]]
    params = GenerationParams(max_new_tokens=12)
    alone = [eng.generate(p, params).output_ids for p in prompts]
    assert [r.output_ids for r in eng.generate_many(prompts, params)] == alone
    ar = SpecEngine(model, options=small_options(k=0, max_seq_len=128, quant="int4"))
    assert [ar.generate(p, params).output_ids for p in prompts] == alone  # int4 speculation is exact too


def test_mistral_sliding_window_caps_the_context():
    model = tiny("mistral", sliding_window=48)
    assert lean_family(model).window == 48
    assert LlamaRunner(model, 128).max_seq_len == 48
    assert LlamaRunner(tiny("qwen2"), 128).max_seq_len == 128  # Qwen's window is off unless its layers ask


def test_unsupported_models_take_the_generic_runner():
    model = tiny("llama-bias", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(UnsupportedModel, match="dynamic"):
        lean_family(model)
    assert isinstance(make_runner(model, 64), HFRunner)
    with pytest.raises(ValueError, match="'int4' needs a model the lean forward runs"):
        make_runner(model, 64, "int4")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_int4_families_take_the_native_forward_near_pytorch_int4(variant):
    native = pytest.importorskip("serve.model.native_runner")
    model = tiny(variant, seed=6, dtype="bfloat16")
    runner = make_runner(model, 128, "int4", cpu_kernels="native")
    assert isinstance(runner, native.NativeLlamaRunner)
    ref = make_runner(model, 128, "int4", cpu_kernels="torch")
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    got, want = lean_logits(runner, ids[:15], ids[15:]), lean_logits(ref, ids[:15], ids[15:])
    # Activations quantized to int8 (native) against bfloat16 (PyTorch): rounding, not structure.
    assert (got - want).abs().max() <= 0.03 * want.abs().max()  # dropping Qwen3's norms: 0.066
    one = torch.stack([lean_logits(runner, ids[:15 + i], ids[15 + i:16 + i])[0] for i in range(5)])
    assert torch.equal(one, got)  # a verify equals its decodes, bit for bit
