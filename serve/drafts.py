"""Draft specs for the engine and the benchmark.

- `none`: no draft (autoregressive).
- `self`: the target as its own draft (acceptance 1 under greedy); measures the cost side.
- `truncate:L`: the target's first L decoder layers with its embedding, final norm and
  head, sharing the target's tensors (no copy).
- a directory: a draft published by `osd draft init` or the trainer (infra/draft_model.py).
Registry versions come with the registry.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from infra.draft_spec import DraftSpecError


def truncated_llama(target: Any, n_layers: int) -> Any:
    from transformers import AutoModelForCausalLM

    total = target.config.num_hidden_layers
    if not 1 <= n_layers <= total:
        raise DraftSpecError(f"truncate:{n_layers} needs 1..{total} layers")
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = n_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:n_layers]
    with torch.device("meta"):
        draft = AutoModelForCausalLM.from_config(cfg, dtype=target.dtype)
    keep = {}
    for name, tensor in target.state_dict(keep_vars=True).items():
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= n_layers:
                continue
        keep[name] = tensor
    draft.load_state_dict(keep, assign=True, strict=True)
    # Non-persistent buffers (RoPE inv_freq) are not in the state dict; share the target's.
    target_buffers = dict(target.named_buffers())
    for name, buf in list(draft.named_buffers()):
        if buf.is_meta:
            owner_name, _, attr = name.rpartition(".")
            draft.get_submodule(owner_name).register_buffer(attr, target_buffers[name], persistent=False)
    if cfg.tie_word_embeddings:
        draft.tie_weights()
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.eval()


def build_draft(spec: str | None, target: Any) -> Any | None:
    if spec in (None, "", "none"):
        return None
    if spec == "self":
        return target
    if spec.startswith("truncate:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise DraftSpecError(f"bad draft spec {spec!r}: expected truncate:L with an integer L") from None
        return truncated_llama(target, n)
    if Path(spec).expanduser().is_dir():
        from infra.draft_model import load_draft  # a published draft directory (digests checked)

        return load_draft(Path(spec).expanduser(), target)[0]
    raise DraftSpecError(f"unknown draft spec {spec!r}: expected none, self, truncate:L or a draft directory")
