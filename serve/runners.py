"""Which runner a model gets: the fast Llama runner, the generic Hugging Face one, or a head
draft's own (serve/head_runner.py); and which Draft (serve/draft.py) a draft model becomes.
Apart from serve/runner.py so the runners never import each other in a circle, and from the
engine so it names no draft family."""

from __future__ import annotations

from typing import Any, Callable

from serve.draft import Draft
from serve.head_runner import HeadRunner
from serve.layer_draft import LayerDraft
from serve.runner import HFRunner, LlamaRunner, Runner
from serve.suffix_draft import HybridDraft, WithSuffix


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


def as_draft(model: Any, runner_for: Callable[[Any], Any]) -> Draft:
    """The Draft serving `model`: a draft with no weights (the suffix draft) as it is; a head
    with the suffix draft beside it as their hybrid; a model's runner (`runner_for`, the
    engine's, which adds CUDA graphs) as itself when it is a draft (the head's), else as a
    layer draft over it."""
    if isinstance(model, Draft):
        return model
    if isinstance(model, WithSuffix):
        return HybridDraft(as_draft(model.model, runner_for), model.suffix)
    runner = runner_for(model)
    return runner if isinstance(runner, Draft) else LayerDraft(runner)
