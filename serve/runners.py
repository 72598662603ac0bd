"""Which runner a model gets: the fast Llama runner, the generic Hugging Face one, or a head
draft's own (serve/head_runner.py). Apart from serve/runner.py so the runners never import
each other in a circle."""

from __future__ import annotations

from typing import Any

from serve.head_runner import HeadRunner
from serve.runner import HFRunner, LlamaRunner, Runner


def make_runner(model: Any, max_seq_len: int | None = None, quant: str = "none") -> Runner:
    """The fast runner for Llama models, the generic one for anything else; a head draft
    (infra/draft_head.py) gets its own runner. `quant` (serve/linear.py) applies to the
    Llama runner only: the generic one refuses it."""
    if getattr(model, "osd_family", None) == "head":
        return HeadRunner(model, max_seq_len, quant)
    if getattr(model.config, "model_type", None) == "llama" and not getattr(model.config, "attention_bias", False):
        return LlamaRunner(model, max_seq_len, quant)
    if quant != "none":
        raise ValueError(f"quant {quant!r} needs a Llama model without attention biases")
    return HFRunner(model, max_seq_len)
