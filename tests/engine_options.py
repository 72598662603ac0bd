"""Engine options as the engine tests were written: two KV slots, a queue of 16 waiting at most
30 s, and the schedule draft length (no cost profiling). The serving defaults (ServeConfig in
infra/config.py, which EngineOptions takes its defaults from) are sized for a replica: 16 slots,
a queue of 1024 waiting 600 s, and the cost policy."""

from serve.engine.core import EngineOptions

SMALL = dict(k_policy="schedule", max_concurrency=2, max_queue=16, queue_timeout_s=30.0)


def small_options(**kw) -> EngineOptions:
    return EngineOptions(**{**SMALL, **kw})
