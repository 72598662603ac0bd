"""Which runner a model gets: the lean runner (Llama and the families of
serve/model/families.py), the native int4 one, or the generic Hugging Face one.
A draft's runner and Draft are chosen a floor up, in serve/spec_decode/factory.py."""

from __future__ import annotations

import logging
from typing import Any

from serve.model.families import UnsupportedModel, lean_family
from serve.model.runner import HFRunner, LlamaRunner, Runner


CPU_KERNELS = ("auto", "native", "torch")
_log = logging.getLogger(__name__)
_said: set[str] = set()


def make_runner(model: Any, max_seq_len: int | None = None, quant: str = "none",
                cpu_kernels: str = "auto") -> Runner:
    """The lean runner for the families it runs, the generic one for anything else. `quant` (serve/model/linear.py) applies to the
    Llama runner only: the generic one refuses it. An int4 Llama on the CPU runs on the
    native kernels (serve/model/native_runner.py) unless `cpu_kernels` is "torch"; "auto"
    falls back to PyTorch's int4 path, saying why once, where they cannot run it."""
    if cpu_kernels not in CPU_KERNELS:
        raise ValueError(f"cpu_kernels must be one of {', '.join(CPU_KERNELS)}, got {cpu_kernels!r}")
    try:
        lean_family(model)
    except UnsupportedModel as e:
        if quant != "none":
            raise ValueError(f"quant {quant!r} needs a model the lean forward runs: {e}") from None
        say_once(f"{e}; the generic Hugging Face runner serves it (exact, slower)")
        return HFRunner(model, max_seq_len)
    if quant == "int4" and cpu_kernels != "torch":
        native = _native_runner(model, max_seq_len, strict=cpu_kernels == "native")
        if native is not None:
            return native
    return LlamaRunner(model, max_seq_len, quant)


def say_once(why: str) -> None:
    """Log a fallback's reason once per process (a runner is built per request draft and swap)."""
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
        say_once(f"int4 target on PyTorch's kernels: {e}")
        return None
