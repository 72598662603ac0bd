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
    cached = load_target("smollm2-135m-instruct", ModelConfig(cache_dir=root), progress=False)
    assert cached.path == cache
    for text in PROMPTS:
        ids = chat_ids(cached.tokenizer, text)
        want = _greedy(ref, ids)
        got = _greedy(cached.model, ids)
        assert got == want, (text, cached.tokenizer.decode(got), cached.tokenizer.decode(want))
        assert len(got) == 16


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

    with pytest.raises(TargetError, match="cannot convert"):
        prepare_smollm2(tmp_path / "cache", progress=False, gguf=cut)
    assert not any((tmp_path / "cache").iterdir())
