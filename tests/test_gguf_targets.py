"""Any GGUF file of the lean families as `model.target` (infra/formats/gguf_file.py, infra/target.py):
tiny GGUFs written here with the `gguf` package (tests/gguf_files.py), one per weight format
and per family. Each loads to exactly the weights it encodes, gives the reference model's
logits, and serves; a bad file is refused with one clear message and leaves no cache."""

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import write_gguf

import gguf
from infra.config import ModelConfig
from infra.formats.gguf_file import SUPPORTED_TYPES
from infra.target import TargetError, build_tiny, identify_target, load_target
from serve.api.chat_template import chat_prompt_ids
from serve.engine.core import GenerationParams, SpecEngine
from engine_options import small_options
from serve.engine.errors import RequestError
from serve.model.linear import dequantize_int4, int4_codes
from serve.model.factory import make_runner

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]

# Widths that are whole k-quant super-blocks (256), one layer: a second per format.
K_SHAPE = dict(vocab_size=259, hidden_size=256, intermediate_size=512, num_layers=1, num_heads=4, num_kv_heads=2,
               max_positions=64)
SHAPE = dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
             max_positions=64)
FAMILY_EXTRA = {"llama": {}, "mistral": dict(sliding_window=None), "qwen2": {}, "qwen3": dict(head_dim=32)}


def _load(path: Path, cache: Path, **cfg):
    return load_target(str(path), ModelConfig(cache_dir=cache, **{"dtype": "float32", "quant": "none", **cfg}),
                       progress=False)


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


IDS = [256, 104, 105, 32, 116, 104, 101, 114, 101, 10, 33, 200, 7]


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
def test_each_weight_format_loads_the_weights_it_encodes(qtype, tmp_path):
    ref = write_gguf(build_tiny("llama", seed=1, **K_SHAPE), tmp_path / "m.gguf", qtype)
    loaded = _load(tmp_path / "m.gguf", tmp_path / "cache")
    got, want = loaded.model.state_dict(), ref.state_dict()
    assert set(got) == set(want)
    for name in want:  # gguf's own dequantization, bit for bit (q/k rows back in Hugging Face's order)
        assert torch.equal(got[name].float(), want[name].float()), name
    torch.testing.assert_close(_logits(loaded.model, IDS), _logits(ref, IDS), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", list(FAMILY_EXTRA))
def test_each_family_serves_from_its_gguf_on_the_lean_forward(family, tmp_path):
    # llama.cpp's converter writes Mistral models with the llama architecture (gguf has no other).
    arch = "llama" if family == "mistral" else family
    ref = write_gguf(build_tiny(family, seed=2, **SHAPE, **FAMILY_EXTRA[family]), tmp_path / "m.gguf", "Q8_0", arch)
    loaded = _load(tmp_path / "m.gguf", tmp_path / "cache")
    assert loaded.model.config.model_type == arch
    runner = make_runner(loaded.model, 64)
    cache = runner.new_cache()
    torch.testing.assert_close(runner.forward(torch.tensor(IDS), cache), _logits(ref, IDS), rtol=1e-4, atol=1e-4)
    prompt = loaded.tokenizer.encode("hi there")
    assert prompt == list(b"hi there")
    eng = SpecEngine(loaded.model, options=small_options(k=0, max_seq_len=64))
    assert len(eng.generate(prompt, GenerationParams(max_new_tokens=8)).output_ids) == 8


def test_q4_1_blocks_come_back_as_the_same_int4_codes(tmp_path):
    write_gguf(build_tiny("llama", seed=3, **SHAPE), tmp_path / "m.gguf", "Q4_1")
    loaded = _load(tmp_path / "m.gguf", tmp_path / "cache")
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    raw = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    blocks = np.asarray(raw.data).reshape(-1, 20)  # Q4_1: d, m (float16), 16 bytes of nibbles
    nib = blocks[:, 4:]
    want = np.concatenate([nib & 15, nib >> 4], axis=1).reshape(64, 128)  # low nibbles are elements 0..15
    codes, scale, lo = int4_codes(loaded.model.model.layers[0].mlp.down_proj.weight)
    assert np.array_equal(codes.numpy(), want)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(64, 4)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(64, 4)
    assert torch.equal(scale.half().float(), torch.from_numpy(d)) and torch.equal(lo.half().float(), torch.from_numpy(m))


@pytest.mark.parametrize("qtype,quant", [("Q4_1", "int4"), ("Q4_0", "int4"), ("Q4_K", "int4"), ("Q8_0", "none"),
                                         ("F16", "none")])
def test_four_bit_files_serve_as_int4_by_default(qtype, quant, tmp_path):
    shape = K_SHAPE if qtype.endswith("_K") else SHAPE
    write_gguf(build_tiny("qwen2", seed=4, **shape), tmp_path / "m.gguf", qtype)
    resolved = ModelConfig(target=str(tmp_path / "m.gguf"), cache_dir=tmp_path / "cache").resolved()
    assert resolved.quant == quant and resolved.dtype == ("bfloat16" if quant == "int4" else "float32")
    if quant == "int4":
        loaded = load_target(str(tmp_path / "m.gguf"), resolved, progress=False)
        eng = SpecEngine(loaded.model, options=small_options(k=0, max_seq_len=64, quant="int4"))
        assert len(eng.generate(IDS, GenerationParams(max_new_tokens=6)).output_ids) == 6


def test_the_cache_is_keyed_by_the_file_and_reused(tmp_path):
    write_gguf(build_tiny("qwen3", seed=5, **SHAPE, head_dim=32), tmp_path / "m.gguf", "F16")
    first = _load(tmp_path / "m.gguf", tmp_path / "cache")
    again = _load(tmp_path / "m.gguf", tmp_path / "cache")
    assert first.path == again.path and first.path.parent == tmp_path / "cache"
    assert identify_target(str(tmp_path / "m.gguf"), ModelConfig(cache_dir=tmp_path / "cache")) == \
        identify_target(str(first.path), ModelConfig(cache_dir=tmp_path / "cache"))


def _truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _unknown_type(path: Path) -> None:
    """Rewrite the first tensor's type (a uint32 after its name, dims and shape) to 99."""
    reader = gguf.GGUFReader(path)
    field = reader.tensors[0].field
    offset = field.offset + sum(p.nbytes for p in field.parts[:-2])
    data = bytearray(path.read_bytes())
    data[offset:offset + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,message", [(_truncated, "truncated"), (_unknown_type, "tensor type")])
def test_a_bad_file_is_refused_and_leaves_no_cache(damage, message, tmp_path):
    write_gguf(build_tiny("llama", seed=6, **SHAPE), tmp_path / "m.gguf", "Q8_0")
    damage(tmp_path / "m.gguf")
    with pytest.raises(TargetError, match=message):
        _load(tmp_path / "m.gguf", tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_a_file_missing_a_tensor_is_refused_not_filled_with_random_weights(tmp_path):
    write_gguf(build_tiny("qwen2", seed=8, **SHAPE), tmp_path / "m.gguf", "Q8_0", skip="blk.1.ffn_down.weight")
    with pytest.raises(TargetError, match="do not fit the model its metadata describes: missing keys"):
        _load(tmp_path / "m.gguf", tmp_path / "cache")
    assert not any((tmp_path / "cache").iterdir())


def test_an_architecture_not_served_is_named(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "m.gguf", "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(TargetError, match="architecture 'gpt2' is not served; supported: llama"):
        _load(tmp_path / "m.gguf", tmp_path / "cache")
    with pytest.raises(TargetError, match="no such file"):
        _load(tmp_path / "missing.gguf", tmp_path / "cache")


def test_chat_needs_the_files_chat_template(tmp_path):
    write_gguf(build_tiny("llama", seed=7, **SHAPE), tmp_path / "m.gguf", "Q8_0", chat_template=False)
    loaded = _load(tmp_path / "m.gguf", tmp_path / "cache")
    with pytest.raises(RequestError, match="no chat template"):
        chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": "hi"}])
    write_gguf(build_tiny("llama", seed=7, **SHAPE), tmp_path / "c.gguf", "Q8_0")
    with_template = _load(tmp_path / "c.gguf", tmp_path / "cache")
    ids = chat_prompt_ids(with_template.tokenizer, [{"role": "user", "content": "hi"}])
    assert with_template.tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_serving_keeps_the_files_4bit_blocks_bit_for_bit(qtype, tmp_path):
    """The served model is bfloat16, which cannot hold the blocks' values; the scales read off the
    float32 weights at load make the int4 weights the file's own again, in the native layout."""
    from infra.formats.quant_codes import EXACT_SCALES
    from serve.model.native_formats import dequantize_q4

    shape = K_SHAPE if qtype == "Q4_K" else SHAPE
    ref = write_gguf(build_tiny("llama", seed=9, **shape), tmp_path / "m.gguf", qtype)  # llama: q/k rows permuted
    cfg = ModelConfig(target=str(tmp_path / "m.gguf"), cache_dir=tmp_path / "cache").resolved()
    loaded = load_target(cfg.target, cfg, progress=False)
    want = dict(ref.named_parameters())
    checked = 0
    for name, w in loaded.model.named_parameters():
        if not name.endswith("proj.weight"):
            continue
        assert w.dtype == torch.bfloat16 and getattr(w, EXACT_SCALES, None) is not None, name
        codes, scale, lo = int4_codes(w, scales=getattr(w, EXACT_SCALES))
        assert torch.equal(dequantize_int4(codes, scale, lo), want[name].float()), name  # the file's codes
        if qtype != "Q4_K":  # float16 scales, as the native layout keeps them: still exact
            assert torch.equal(dequantize_q4(codes, scale, lo), want[name].float()), name
        checked += 1
    assert checked == 7 * shape["num_layers"]


def test_a_q8_0_head_keeps_its_scales_and_a_k_quants_come_from_its_blocks(tmp_path):
    from infra.formats.quant_codes import EXACT_SCALES, keep_exact_scales

    q8 = write_gguf(build_tiny("llama", seed=10, **SHAPE), tmp_path / "q8.gguf", "Q8_0")
    keep_exact_scales(q8)
    assert getattr(q8.lm_head.weight, EXACT_SCALES, None) is not None
    assert getattr(q8.model.layers[0].mlp.down_proj.weight, EXACT_SCALES, None) is None  # 8-bit, not 4
    qk = write_gguf(build_tiny("llama", seed=10, **K_SHAPE), tmp_path / "qk.gguf", "Q4_K")
    keep_exact_scales(qk)  # a Q4_K block's scales cannot be read off its weights: the file's blocks give them
    assert getattr(qk.model.layers[0].mlp.down_proj.weight, EXACT_SCALES, None) is None


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("rope", [LLAMA3_ROPE, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
                                  {**LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 2048}],
                         ids=["llama3.2", "linear", "llama3-other"])
def test_rope_scaling_comes_back_from_the_file(rope, tmp_path):
    """transformers' GGUF reader drops a llama file's RoPE scaling; without infra/formats/gguf_rope.py
    these logits are another model's."""
    shape = {**SHAPE, "max_positions": 16384}
    ref = write_gguf(build_tiny("llama", seed=11, **shape, rope_parameters=rope), tmp_path / "m.gguf", "F32")
    loaded = _load(tmp_path / "m.gguf", tmp_path / "cache")
    assert loaded.model.config.rope_parameters["rope_type"] == rope["rope_type"]
    torch.testing.assert_close(_logits(loaded.model, IDS), _logits(ref, IDS), rtol=1e-4, atol=1e-4)
    plain = build_tiny("llama", seed=11, **shape)
    plain.load_state_dict(ref.state_dict())
    assert (_logits(plain, IDS) - _logits(ref, IDS)).abs().max() > 1e-3  # the scaling matters here


def _count_reads(monkeypatch) -> list[int]:
    reads = [0]
    real = gguf.GGUFReader

    def counted(*a, **kw):
        reads[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(gguf, "GGUFReader", counted)
    return reads


def test_a_files_info_is_read_once_per_version_of_the_file(tmp_path, monkeypatch):
    import os

    from infra.formats.gguf_file import read_gguf_info

    path = tmp_path / "m.gguf"
    write_gguf(build_tiny("llama", seed=8, **SHAPE), path, "Q8_0")
    reads = _count_reads(monkeypatch)
    read_gguf_info(path), read_gguf_info(path)
    assert reads[0] == 2  # just written: a rewrite in the same clock tick could keep its mtime
    os.utime(path, ns=(10**18, 10**18))
    first = read_gguf_info(path)
    assert read_gguf_info(path) == first and reads[0] == 3
    write_gguf(build_tiny("qwen3", seed=9, **SHAPE, head_dim=32), path, "F16", "qwen3")
    os.utime(path, ns=(10**18 + 1, 10**18 + 1))
    assert read_gguf_info(path).architecture == "qwen3" and reads[0] == 4  # a new version is read


def test_a_cache_hit_does_not_read_the_file_again(tmp_path, monkeypatch):
    write_gguf(build_tiny("llama", seed=10, **SHAPE), tmp_path / "m.gguf", "Q8_0")
    cfg = ModelConfig(cache_dir=tmp_path / "cache")
    first = identify_target(str(tmp_path / "m.gguf"), cfg)  # converts: reads it
    reads = _count_reads(monkeypatch)
    assert identify_target(str(tmp_path / "m.gguf"), cfg) == first and reads[0] == 0
