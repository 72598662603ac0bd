"""RoPE scaling of a GGUF file, as Hugging Face `rope_parameters`. transformers' GGUF reader
leaves it out for these families (it reconstructs it for gpt-oss only), so a Llama 3.x file
would load with plain RoPE and give another model's logits.

llama.cpp writes it two ways:
- `{arch}.rope.scaling.type` (`linear`, `yarn`) with `.factor` and `.original_context_length`;
- Llama 3's scaling as a tensor, `rope_freqs.weight`: per frequency, the divisor that the
  llama3 rule applies to plain RoPE's. The rule depends on four numbers (factor, low and high
  frequency factors, original context). The factor is the largest divisor; the others are
  found among the values Meta's models use, each candidate checked against every divisor
  through transformers' own llama3 rule.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import numpy as np

from infra.formats.gguf_file import GgufError

_LOW = (1.0, 2.0, 4.0)
_HIGH = (4.0, 2.0, 8.0, 16.0)
_ORIGINAL = tuple(2 ** k for k in range(8, 18))


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _divisors(config: Any, params: dict) -> np.ndarray:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = copy.deepcopy(config)
    cfg.rope_parameters = params
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    plain = params["rope_theta"] ** -(np.arange(0, hd, 2, dtype=np.float64) / hd)
    return plain / scaled.double().numpy()


def _llama3(divisors: np.ndarray, config: Any, theta: float) -> dict:
    factor = float(divisors.max())
    for low, high, original in itertools.product(_LOW, _HIGH, _ORIGINAL):
        if high <= low:
            continue
        params = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
                  "high_freq_factor": high, "original_max_position_embeddings": original}
        if np.allclose(_divisors(config, params), divisors, rtol=1e-5, atol=0):
            return params
    raise GgufError(f"rope_freqs.weight matches no llama3 RoPE scaling this loader knows (factor {factor:g}); "
                    f"not served")


def gguf_rope_parameters(reader: Any, arch: str, config: Any) -> dict | None:
    """The `rope_parameters` the file's RoPE scaling amounts to, or None for plain RoPE."""
    theta = float(config.rope_parameters["rope_theta"])
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if kind in (None, "none"):
        tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
        if tensor is None:
            return None
        return _llama3(np.asarray(tensor.data, dtype=np.float64).reshape(-1), config, theta)
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(factor)}
    if kind == "yarn":
        params = {"rope_type": "yarn", "rope_theta": theta, "factor": float(factor)}
        if original is not None:
            params["original_max_position_embeddings"] = int(original)
        return params
    raise GgufError(f"rope scaling {kind!r} is not served; served: linear, yarn, and llama3 (rope_freqs)")
