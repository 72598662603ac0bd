"""The decoder families the lean forward runs (serve/model/runner.py `LlamaRunner`, and the native
forward over it), each described by what differs from Llama, read off its Hugging Face
config and weights; anything else takes the generic runner (`HFRunner`).

- Llama 2 and 3.x: the base. `attention_bias` adds biases to q, k, v and o. RoPE scaling
  (`llama3`, `linear`, `yarn`) lives in the tables both forwards take from the model's own
  rotary module; `dynamic` rescales per forward by the sequence's length, which fixed tables
  cannot follow, so such a model takes the generic runner.
- Mistral: Llama's layer; its sliding window caps the context (below).
- Qwen2 / Qwen2.5: biases on q, k and v (not o).
- Qwen3: an RMSNorm over each head of q and of k before RoPE; no biases.

Gemma 2 and 3 are not here. They would need `(1 + w)` norms, norms after attention and after
the MLP as well as before, GeGLU (tanh GELU) instead of SiLU, embeddings scaled by sqrt(D),
soft-capped attention scores and logits, and alternating local and global layers, in both
forwards; they take the generic runner, exact but slow.

A sliding window (Mistral's, or Qwen's where `layer_types` asks for one) is honoured by
capping the context at the window: within it, sliding attention is full attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infra.target import LEAN_FAMILIES
# RoPE variants whose tables depend on the position alone (computed once for the context).
STATIC_ROPE = ("default", "llama3", "linear", "yarn")


class UnsupportedModel(TypeError):
    """The lean forward cannot run this model (the message says why); the generic runner can."""


@dataclass(frozen=True)
class Family:
    name: str
    qkv_bias: bool = False  # q, k and v projections carry biases
    o_bias: bool = False  # the output projection carries one
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE
    window: int | None = None  # sliding window, tokens (the context is capped to it)

    def context(self, limit: int) -> int:
        """The longest sequence the lean forward serves under `limit`."""
        return min(limit, self.window) if self.window else limit


def rope_type(config: Any) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default")))


def _window(config: Any) -> int | None:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    if layer_types is None and getattr(config, "use_sliding_window", None) is False:
        return None
    return int(window) if window else None


def lean_family(model: Any) -> Family:
    """The family of a Hugging Face causal LM, or UnsupportedModel saying why the lean forward
    cannot run it."""
    cfg = model.config
    kind = getattr(cfg, "model_type", None)
    if kind not in LEAN_FAMILIES:
        raise UnsupportedModel(f"model_type {kind!r}: the lean forward runs {', '.join(LEAN_FAMILIES)}")
    if getattr(cfg, "mlp_bias", False):
        raise UnsupportedModel("mlp_bias: the lean forward's MLP has no biases")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {cfg.hidden_act!r}: the lean forward's MLP is SwiGLU (silu)")
    rope = rope_type(cfg)
    if rope not in STATIC_ROPE:
        raise UnsupportedModel(f"rope type {rope!r}: the lean forward takes {', '.join(STATIC_ROPE)}")
    attn = model.model.layers[0].self_attn
    return Family(
        name=kind,
        qkv_bias=getattr(attn.q_proj, "bias", None) is not None,
        o_bias=getattr(attn.o_proj, "bias", None) is not None,
        qk_norm=getattr(attn, "q_norm", None) is not None,
        window=_window(cfg),
    )
