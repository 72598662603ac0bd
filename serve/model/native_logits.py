"""A step's reads of its logit rows in native code (serve/model/native/logits.h): each row's
argmax, for greedy verify, and its k largest entries with their log-probabilities, for the
records. PyTorch's CPU argmax and topk take 70-110 us for one row of a 49,152-token vocabulary
(docs/benchmarks.md), and a step reads every verified row.

The argmax is PyTorch's (the first of equal maxima); the top-k are the same entries in the same
order (the lower id first among equal values), and their log-probabilities agree with
`topk_logprobs`' to float rounding. `OSD_NATIVE_LOGITS=off` (or `OSD_NATIVE_ISA=off`) leaves
them to PyTorch.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from serve.model.native_build import NativeUnavailable, load
from serve.model.native_runner import forward_threads

MAX_TOP_K = 64  # logits.h kMaxTopK


@functools.cache
def _lib() -> ctypes.CDLL | None:
    if os.environ.get("OSD_NATIVE_LOGITS", "on") == "off":
        return None
    try:
        lib = load()
    except NativeUnavailable:
        return None
    if lib.osd_logit_stats is None:
        return None
    # The same library through a handle whose calls keep the GIL: a read takes well under a
    # millisecond, and a step thread that released the GIL for it would wait up to Python's
    # switch interval (5 ms) to take it back from the replica's other threads.
    held = ctypes.PyDLL(lib._name)
    held.osd_logit_stats.restype = lib.osd_logit_stats.restype
    held.osd_logit_stats.argtypes = lib.osd_logit_stats.argtypes
    return held


def available() -> bool:
    return _lib() is not None


def logit_stats(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(argmax [rows], top-k ids [rows, k], top-k log-probs [rows, k]) of logit rows [rows, V],
    or None where PyTorch must read them: no native library, rows not float32 on the CPU, k
    out of range, or a row holding a NaN or +inf. k = 0: the argmax alone (empty top-k)."""
    lib = _lib()
    if (lib is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or not 0 <= k <= min(MAX_TOP_K, logits.shape[1])):
        return None
    x = logits.contiguous()
    rows = x.shape[0]
    amax = torch.empty(rows, dtype=torch.long)
    ids = torch.empty(rows, k, dtype=torch.long)
    lps = torch.empty(rows, k, dtype=torch.float32)
    if rows and lib.osd_logit_stats(x.data_ptr(), rows, x.shape[1], k, amax.data_ptr(), ids.data_ptr(),
                                    lps.data_ptr(), forward_threads()):
        return None
    return amax, ids, lps
