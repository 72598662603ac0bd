"""How a native runner runs small forwards on this machine, decided by measuring it at load.

A forward of a few rows is bound by reading the weights, and two machines this project runs on
stream them differently:
- **Threads.** Where one core streams the weights nearly as fast as all of them (AMD's Zen 4
  here), a small step runs on one thread and leaves the other cores to the HTTP ingress, which
  raised one client's output. Where one core streams far less (Intel's server cores, whose
  bandwidth per core is bound by the misses each keeps in flight), that halves the step's speed.
- **Prefetch.** Asking for the next weight tile ahead of the hardware prefetcher made Intel's
  one-row step faster and was no better on the Zen 4 (serve/model/native/gemm.h).
- **AMX tiles.** On a CPU with AMX-INT8 (Intel's Sapphire Rapids and later), GEMMs of
  AMX_MIN_ROWS rows or more can take their integer dots from tile multiplies
  (serve/model/native/amx.h), with the same bits; whether that pays is timed on a forward of
  AMX_PROBE_ROWS rows.
So a runner times its one-row step each way once, at load, and keeps what was faster;
docs/benchmarks.md has both machines' figures.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger(__name__)

# Rows up to which a forward may run on one thread.
SMALL_FORWARD_ROWS = 4
# One thread is kept for small forwards while its one-row step is at most this much slower than
# with every thread: the freed core is worth that to the ingress, not more.
ONE_THREAD_SLACK = 1.15
# Packed weights below this size are not measured: their step is call overhead, not bandwidth
# (the tests' tiny models), and they keep the defaults.
MEASURE_MIN_BYTES = 16 << 20
REPEATS = 7
# Rows from which the GEMMs use AMX tiles where that pays: below them a tile's fixed cost is
# more than the VNNI kernels' per-row work (docs/benchmarks.md, "AMX tiles").
AMX_MIN_ROWS = 9
AMX_PROBE_ROWS = 16
# Idle before measuring, so that thread pools still spinning after loading (torch's OpenMP) are
# not charged to the step.
SETTLE_S = 0.05


@dataclass(frozen=True)
class Tuning:
    small_rows: int = SMALL_FORWARD_ROWS  # forwards of at most this many rows run on one thread
    prefetch: bool = True  # GEMMs of a few rows (gemm.h kSmallRows) prefetch the next weight tile
    amx_rows: int = 0  # GEMMs of at least this many rows use AMX tiles (0: never)
    ms: dict[str, float] = field(default_factory=dict)  # each way's fastest forward


Step = Callable[[int, bool], None]  # a one-row forward on n threads, prefetching or not
# An AMX_PROBE_ROWS-row forward on every thread, AMX from n rows (0: off), prefetching or not.
Wide = Callable[[int, bool], None]

_decided: dict[tuple, Tuning] = {}


def _fastest(ways: dict[Any, Callable[[], None]]) -> dict[Any, float]:
    """Each way's fastest of REPEATS, interleaved, after one warm call each."""
    times: dict[Any, list[float]] = {way: [] for way in ways}
    for run in ways.values():
        run()
    for _ in range(REPEATS):
        for way, run in ways.items():
            t0 = time.perf_counter()
            run()
            times[way].append(time.perf_counter() - t0)
    return {way: min(ts) for way, ts in times.items()}


def tune(key: tuple, weight_bytes: int, threads: int, step: Step, wide: Wide | None = None) -> Tuning:
    """The ways of running a one-row step (`step(threads, prefetch)`): prefetch where it is no
    slower on all threads; one thread for small forwards where it is within ONE_THREAD_SLACK of
    all of them. Each way's fastest of REPEATS, interleaved, after one warm step each (a replica
    measures while the rest of the stack starts beside it, whose work only ever adds time); once
    per `key`."""
    if weight_bytes < MEASURE_MIN_BYTES:
        return Tuning()
    if key in _decided:
        return _decided[key]
    ways = [(threads, True), (threads, False)] + ([(1, True), (1, False)] if threads > 1 else [])
    time.sleep(SETTLE_S)
    fastest = _fastest({(n, pf): (lambda n=n, pf=pf: step(n, pf)) for n, pf in ways})
    prefetch = fastest[(threads, True)] <= fastest[(threads, False)]
    small = SMALL_FORWARD_ROWS
    if threads > 1 and fastest[(1, prefetch)] > ONE_THREAD_SLACK * fastest[(threads, prefetch)]:
        small = 0
    ms = {f"{n} thread{'s' * (n > 1)}{'' if pf else ', no prefetch'}": 1e3 * t for (n, pf), t in fastest.items()}
    amx = 0
    if wide is not None:
        probe = _fastest({AMX_MIN_ROWS: lambda: wide(AMX_MIN_ROWS, prefetch), 0: lambda: wide(0, prefetch)})
        amx = AMX_MIN_ROWS if probe[AMX_MIN_ROWS] < probe[0] else 0
        ms.update({f"{AMX_PROBE_ROWS} rows, AMX": 1e3 * probe[AMX_MIN_ROWS], f"{AMX_PROBE_ROWS} rows, no AMX": 1e3 * probe[0]})
    out = Tuning(small, prefetch, amx, ms)
    rule = f"forwards of up to {small} rows on one thread" if small else f"every forward on {threads} threads"
    log.info("native forward: %s ms: %s, %s%s", ", ".join(f"{k} {v:.2f}" for k, v in out.ms.items()),
             rule, "prefetching" if prefetch else "no prefetch",
             f", AMX from {amx} rows" if amx else (", no AMX" if wide is not None else ""))
    _decided[key] = out
    return out


def amx_allowed() -> bool:
    """OSD_NATIVE_AMX=off keeps the GEMMs off AMX tiles (to time or rule them out); auto, the
    default, measures whether they pay. Any other value is refused, not read as auto."""
    value = os.environ.get("OSD_NATIVE_AMX", "auto").strip().lower() or "auto"
    if value not in ("auto", "off"):
        raise ValueError(f"OSD_NATIVE_AMX must be auto or off, got {value!r}")
    return value == "auto"


def _forward_from_start(runner: Any, rows: int) -> Callable[[int], None]:
    """A forward of `rows` rows of `runner` from position 0 on n threads, over a cache of its own."""
    import torch

    from serve.model.batch_forward import Item

    cache = runner.new_cache()
    tokens = torch.zeros(rows, dtype=torch.long)

    def run(threads: int) -> None:
        cache.length = 0
        runner.forward_rows_on([Item(tokens, cache)], threads=threads)

    return run


def measure_step(runner: Any) -> Step:
    """A one-row forward of `runner` on n threads, prefetching or not."""
    run = _forward_from_start(runner, 1)

    def step(n: int, prefetch: bool) -> None:
        runner.lib.osd_set_prefetch(int(prefetch))
        run(n)

    return step


def measure_wide(runner: Any, threads: int) -> Wide:
    """An AMX_PROBE_ROWS-row forward of `runner` on `threads`, AMX tiles from n rows, prefetching or not."""
    run = _forward_from_start(runner, AMX_PROBE_ROWS)

    def wide(n: int, prefetch: bool) -> None:
        runner.lib.osd_set_prefetch(int(prefetch))
        runner.lib.osd_set_amx(n)
        run(threads)

    return wide
