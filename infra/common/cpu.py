"""What this CPU does fast: read by the serving runner (its wide weights) and the head's warm
start (its autocast dtype), which must not guess from the dtype alone."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

X86 = ("x86_64", "amd64", "i386", "i686")
# The x86 flags of bfloat16 GEMM instructions: AVX-512 BF16 (Cooper Lake, Sapphire Rapids, Zen 4)
# and AMX (Sapphire Rapids).
X86_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The first CPU's flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def bf16_gemm_is_native(machine: str, flags: set[str], onednn_says: bool) -> bool:
    """oneDNN reports bfloat16 as supported on every AVX-512 CPU, and on one without AVX-512 BF16
    or AMX (Skylake-SP, Cascade Lake, Ice Lake) it emulates the GEMMs: 4.6-5x slower than
    float32 on an Ice Lake (docs/benchmarks.md, "The head's steps on an AVX-512 CPU without
    bfloat16 instructions"). So on x86 the CPU's flags decide where /proc/cpuinfo lists them;
    elsewhere (Arm) oneDNN's own answer does."""
    if machine.lower() in X86 and flags:
        return bool(flags & X86_BF16_FLAGS) and onednn_says
    return onednn_says


@functools.cache
def native_bf16_gemm() -> bool:
    """Whether bfloat16 GEMMs run on the CPU's own instructions (AVX-512 BF16 or AMX). Without
    them (AVX2-only CPUs, and AVX-512 ones before Cooper Lake) they are emulated, several times
    slower than float32, where the CPUs that have them run bfloat16 faster than float32."""
    import torch  # here, so the native build's set-up step (serve/model/native_build.py) stays torch-free

    try:
        onednn_says = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the probe: the flags alone decide
        onednn_says = True
    return bf16_gemm_is_native(platform.machine(), cpu_flags(), onednn_says)


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
