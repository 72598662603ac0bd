"""What this CPU does fast: read by the serving runner (its wide weights) and the head's warm
start (its autocast dtype), which must not guess from the dtype alone."""

from __future__ import annotations

import functools

import torch


@functools.cache
def native_bf16_gemm() -> bool:
    """Whether oneDNN multiplies bfloat16 with the CPU's own instructions (AVX-512 or AMX).
    Without them (an AVX2-only CPU: AMD Zen 2/3, older Intel) it emulates them: a GEMM of 64
    rows of SmolLM2's shape took 8.0 ms in bfloat16 against 1.7 in float32 on 2 Zen 3 cores,
    where AVX-512 machines run bfloat16 1.3-1.45x faster than float32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the probe: assume the fast path
        return True
