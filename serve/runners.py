"""Which runner a model gets: the lean runner (Llama and the families of
serve/model/families.py), the generic Hugging Face one, or a head
draft's own (serve/head_runner.py); and which Draft (serve/draft.py) a draft model becomes.
Apart from serve/runner.py so the runners never import each other in a circle, and from the
engine so it names no draft family."""

from __future__ import annotations

import logging
from typing import Any, Callable

from serve.draft import Draft
from serve.head_runner import HeadRunner
from serve.layer_draft import LayerDraft
from serve.model.families import UnsupportedModel, lean_family
from serve.runner import HFRunner, LlamaRunner, Runner
from serve.suffix_draft import HybridDraft, WithSuffix


CPU_KERNELS = ("auto", "native", "torch")
_log = logging.getLogger(__name__)
_said: set[str] = set()


def make_runner(model: Any, max_seq_len: int | None = None, quant: str = "none",
                cpu_kernels: str = "auto") -> Runner:
    """The lean runner for the families it runs, the generic one for anything else; a head draft
    (infra/draft_head.py) gets its own runner. `quant` (serve/linear.py) applies to the
    Llama runner only: the generic one refuses it. An int4 Llama on the CPU runs on the
    native kernels (serve/model/native_runner.py) unless `cpu_kernels` is "torch"; "auto"
    falls back to PyTorch's int4 path, saying why once, where they cannot run it."""
    if cpu_kernels not in CPU_KERNELS:
        raise ValueError(f"cpu_kernels must be one of {', '.join(CPU_KERNELS)}, got {cpu_kernels!r}")
    if getattr(model, "osd_family", None) == "head":
        return HeadRunner(model, max_seq_len, quant)
    try:
        lean_family(model)
    except UnsupportedModel as e:
        if quant != "none":
            raise ValueError(f"quant {quant!r} needs a model the lean forward runs: {e}") from None
        _say_once(f"{e}; the generic Hugging Face runner serves it (exact, slower)")
        return HFRunner(model, max_seq_len)
    if quant == "int4" and cpu_kernels != "torch":
        native = _native_runner(model, max_seq_len, strict=cpu_kernels == "native")
        if native is not None:
            return native
    return LlamaRunner(model, max_seq_len, quant)


def _say_once(why: str) -> None:
    if why not in _said:
        _said.add(why)
        _log.warning(why)


def _native_runner(model: Any, max_seq_len: int | None, strict: bool) -> Runner | None:
    from serve.model.native_build import NativeUnavailable
    from serve.model.native_runner import NativeLlamaRunner

    try:
        return NativeLlamaRunner(model, max_seq_len)
    except (NativeUnavailable, ValueError) as e:
        if strict:
            raise ValueError(f"model.cpu_kernels native: {e}") from None
        _say_once(f"int4 target on PyTorch's kernels: {e}")
        return None


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
