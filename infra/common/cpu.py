"""What this CPU does fast: read by the serving runner (its wide weights) and the head's warm
start (its autocast dtype), which must not guess from the dtype alone."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch


@functools.cache
def native_bf16_gemm() -> bool:
    """Whether oneDNN multiplies bfloat16 with the CPU's own instructions (AVX-512 or AMX).
    Without them (an AVX2-only CPU: AMD Zen 2/3, older Intel) it emulates them, several times
    slower than float32, where AVX-512 machines run bfloat16 faster than float32
    (docs/benchmarks.md, "On a CPU without native bfloat16")."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the probe: assume the fast path
        return True


def usable_cores(cgroup: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The cores this process may run on: its affinity, capped by a cgroup v2 CPU quota (a
    container's limit, which the affinity mask does not show)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = cgroup.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def replica_threads(forward_threads: int, num_replicas: int, num_cpus_per_replica: float) -> int:
    """A serving replica's forward threads: serve.forward_threads where set; else a lone replica takes every usable core, sharing them with the local stack (the
    HTTP ingress, Ray's proxy, Redis: the native forward's threads claim work item by item, so
    one that the ingress takes off its core holds up little); replicas that share a machine
    take their num_cpus_per_replica each. One thread leaves the ingress a core of its own,
    which pays only while the load is light (docs/benchmarks.md, "Figures behind code
    choices")."""
    if forward_threads:
        return forward_threads
    if num_replicas == 1:
        return usable_cores()
    return max(1, int(num_cpus_per_replica))
