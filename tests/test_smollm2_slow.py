"""Real SmolLM2 weights: the cached safetensors must decode exactly like the GGUF model."""

import pytest
import torch

from infra.config import ModelConfig
from infra.prompts import chat_ids
from infra.target import MANIFEST, load_target, prepare_smollm2, smollm2_gguf_path

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a python function that reverses a string.",
    "Give me three tips for a job interview.",
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    # A private cache dir, so this exercises a real conversion every run.
    root = tmp_path_factory.mktemp("models")
    return root, prepare_smollm2(root, progress=False)


def _greedy(model, ids, n=16):
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
    return out[0, len(ids):].tolist()


def test_cached_safetensors_match_gguf_greedy(converted):
    from transformers import AutoModelForCausalLM

    root, cache = converted
    assert (cache / MANIFEST).is_file() and (cache / "model.safetensors").is_file()
    gguf = smollm2_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    # float32: the conversion is checked against the GGUF model transformers builds, in float32.
    cached = load_target("smollm2-135m-instruct", ModelConfig(cache_dir=root, dtype="float32"), progress=False)
    assert cached.path == cache
    for text in PROMPTS:
        ids = chat_ids(cached.tokenizer, text)
        want = _greedy(ref, ids)
        got = _greedy(cached.model, ids)
        assert got == want, (text, cached.tokenizer.decode(got), cached.tokenizer.decode(want))
        assert len(got) == 16


def test_int4_weights_are_the_ggufs_own_q4_1_blocks(converted):
    """Group-wise min/max int4 of the cached (dequantized) weights gives back the GGUF's codes, d
    and m exactly, for tensors that llama.cpp's conversion does not permute."""
    import gguf
    import numpy as np

    from serve.model.linear import int4_codes

    root, _ = converted
    model = load_target("smollm2-135m-instruct", ModelConfig(cache_dir=root, dtype="float32"), progress=False).model
    params = dict(model.named_parameters())
    tensors = {t.name: t for t in gguf.GGUFReader(str(smollm2_gguf_path())).tensors}
    for gname, hname in (("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
                         ("blk.5.attn_v.weight", "model.layers.5.self_attn.v_proj.weight"),
                         ("blk.29.ffn_gate.weight", "model.layers.29.mlp.gate_proj.weight")):
        t = tensors[gname]
        assert t.tensor_type.name == "Q4_1"
        blocks = np.asarray(t.data).reshape(t.data.shape[0], -1, 20)  # per block: f16 d, f16 m, 16 bytes
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:20]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(qs.shape[0], -1)  # low nibbles first
        codes, scale, lo = int4_codes(params[hname])
        assert np.array_equal(codes.numpy(), q), gname
        assert np.array_equal(scale.numpy(), d) and np.array_equal(lo.numpy(), m), gname


def test_second_prepare_is_a_cache_hit(converted):
    root, cache = converted
    before = (cache / "model.safetensors").stat().st_mtime_ns
    assert prepare_smollm2(root, progress=False) == cache
    assert (cache / "model.safetensors").stat().st_mtime_ns == before


def test_truncated_gguf_is_refused(tmp_path):
    gguf = smollm2_gguf_path()
    cut = tmp_path / gguf.name
    with open(gguf, "rb") as f:
        cut.write_bytes(f.read(gguf.stat().st_size // 2))
    from infra.target import TargetError

    with pytest.raises(TargetError, match="truncated"):
        prepare_smollm2(tmp_path / "cache", progress=False, gguf=cut)
    assert not (tmp_path / "cache").exists()  # refused before anything is written
