"""Which runner and which Draft (serve/spec_decode/protocol.py) a draft model gets. Here, not in
serve/model/, so the model floor never names a draft family, and the engine names none either."""

from __future__ import annotations

from typing import Any, Callable

from serve.model.factory import make_runner
from serve.model.runner import Runner
from serve.spec_decode.head.draft import HeadRunner
from serve.spec_decode.layer import LayerDraft
from serve.spec_decode.protocol import Draft
from serve.spec_decode.suffix.draft import HybridDraft, WithSuffix


def draft_runner(model: Any, max_seq_len: int | None = None, quant: str = "none",
                 cpu_kernels: str = "auto") -> Runner:
    """A head draft (infra/drafts/head.py) gets its own runner; any other draft model the runner a
    target of its kind would get (serve/model/factory.py)."""
    if getattr(model, "osd_family", None) == "head":
        return HeadRunner(model, max_seq_len, quant, cpu_kernels)
    return make_runner(model, max_seq_len, quant, cpu_kernels)


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
