"""How many threads a small native forward takes, decided by measuring this machine.

A forward of a few rows is bound by reading the weights. Where one core streams them nearly as
fast as all of them (AMD's Zen 4 here), a small step runs on one thread and leaves the other
cores to the HTTP ingress, which raised one client's output. Where one core streams far less
(Intel's server cores, whose per-core bandwidth is bound by the misses each core keeps in
flight), that halves the step's speed. So a runner times its one-row step both ways once, at
load, and keeps the faster rule; docs/benchmarks.md has both machines' figures.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

# Rows up to which a forward may run on one thread.
SMALL_FORWARD_ROWS = 4
# One thread is kept for small forwards while its one-row step is at most this much slower than
# with every thread: the freed core is worth that to the ingress, not more.
ONE_THREAD_SLACK = 1.15
# Packed weights below this size are not measured: their step is call overhead, not bandwidth
# (the tests' tiny models), and they keep the one-thread rule.
MEASURE_MIN_BYTES = 16 << 20
REPEATS = 5
# Idle before measuring, so that thread pools still spinning after loading (torch's OpenMP) are
# not charged to the step.
SETTLE_S = 0.05

_decided: dict[tuple, int] = {}


def small_forward_rows(key: tuple, weight_bytes: int, threads: int, step: Callable[[int], None]) -> int:
    """SMALL_FORWARD_ROWS where a one-row forward on one thread (`step(1)`) is within
    ONE_THREAD_SLACK of one on `threads` threads (`step(threads)`), else 0; measured once per
    `key` in a process (medians of REPEATS, interleaved, after one warm step each)."""
    if threads <= 1 or weight_bytes < MEASURE_MIN_BYTES:
        return SMALL_FORWARD_ROWS
    if key in _decided:
        return _decided[key]
    time.sleep(SETTLE_S)
    times: dict[int, list[float]] = {1: [], threads: []}
    for n in times:
        step(n)
    for _ in range(REPEATS):
        for n, ts in times.items():
            t0 = time.perf_counter()
            step(n)
            ts.append(time.perf_counter() - t0)
    one, many = statistics.median(times[1]), statistics.median(times[threads])
    rows = SMALL_FORWARD_ROWS if one <= ONE_THREAD_SLACK * many else 0
    rule = f"forwards of up to {rows} rows run on one thread" if rows else f"every forward runs on {threads} threads"
    log.info("native forward: a one-row step takes %.2f ms on 1 thread, %.2f ms on %d: %s",
             1e3 * one, 1e3 * many, threads, rule)
    _decided[key] = rows
    return rows


def decided() -> dict[tuple, int]:
    """What this process measured so far (benches report it)."""
    return dict(_decided)


def measure_step(runner: Any) -> Callable[[int], None]:
    """A one-row forward of `runner` on n threads, over a cache of its own."""
    import torch

    from serve.model.batch_forward import Item

    cache = runner.new_cache()
    token = torch.zeros(1, dtype=torch.long)

    def step(n: int) -> None:
        cache.length = 0
        runner.forward_rows_on([Item(token, cache)], threads=n)

    return step
