"""Tiny GGUF files written in the tests with the `gguf` package's writer, from a tiny Hugging
Face model: its weights in one GGUF type, llama.cpp's tensor names, q/k rows in the order
llama.cpp's converter writes them for the llama architecture, and a byte-level BPE tokenizer.

`write_gguf` returns the reference model: the same architecture holding exactly the weights
the file encodes (gguf's own dequantization of each block), which a loader must reproduce.
Types gguf can quantize are quantized from the model's weights; for the k-quants, which it only
reads, the blocks are random bytes with small scales, so every code and scale is exercised."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch

import gguf
from gguf import GGMLQuantizationType as Q

# Offsets of the float16 super-block scales inside each k-quant block, set to small values so
# the random blocks dequantize to weights of a trained model's size.
K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
TOKENS_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def _permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter order for llama q/k rows: each head's two rotary halves interleaved."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _blocks(w: np.ndarray, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """The raw blocks of w [N, K] in `qtype` (random ones for the k-quants)."""
    t = Q[qtype]
    if qtype in K_SCALES:
        block, size = gguf.GGML_QUANT_SIZES[t]
        raw = rng.integers(0, 256, (w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
        for off in K_SCALES[qtype]:
            raw[..., off:off + 2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
        return raw.reshape(w.shape[0], -1)
    return gguf.quants.quantize(w.astype(np.float32), t)


def write_gguf(model, path: Path, qtype: str, arch: str | None = None, chat_template: bool = True,
               seed: int = 0, skip: str | None = None):
    """Write `model` (a tiny model of a lean family) as a GGUF whose 2-D weights are `qtype`
    (norms and biases stay F32); return the reference model of the file's exact weights.
    `skip`: a GGUF tensor name left out (a broken file)."""
    cfg = model.config
    arch = arch or cfg.model_type
    n_layers = cfg.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layers)
    ref = copy.deepcopy(model).float()
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    tokens = _byte_tokens() + TOKENS_SPECIAL
    assert len(tokens) == cfg.vocab_size, "the tokenizer's vocabulary is the model's"
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * len(TOKENS_SPECIAL))
    w.add_token_scores([0.0] * len(tokens))
    w.add_bos_token_id(256)
    w.add_eos_token_id(258)
    if chat_template:
        w.add_chat_template(CHAT_TEMPLATE)
    state = ref.state_dict()
    for name, tensor in state.items():
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        if gname == skip:
            continue
        data = tensor.detach().float().numpy()
        if data.ndim == 1:
            w.add_tensor(gname, data.astype(np.float32))
            continue
        if qtype in ("F32", "F16"):
            raw = data.astype(np.float32 if qtype == "F32" else np.float16)
            exact = raw.astype(np.float32)
        else:
            raw = _blocks(data, qtype, rng)
            exact = gguf.quants.dequantize(raw, Q[qtype]).reshape(data.shape)
        tensor.copy_(torch.from_numpy(np.ascontiguousarray(exact)))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            raw = _permute(raw, heads)
        if qtype not in ("F32", "F16"):
            w.add_tensor(gname, raw, raw_dtype=Q[qtype])
        else:
            w.add_tensor(gname, raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref.eval()
