"""Engine options as the engine tests were written: two KV slots, a queue of 16 waiting at most
30 s, and the schedule draft length (no cost profiling). The serving defaults (ServeConfig in
infra/config.py, which EngineOptions takes its defaults from) are sized for a replica: 16 slots,
a queue of 1024 waiting 600 s, and the cost policy. And `stream_all`: requests streamed
together, each with its own parameters."""

import asyncio

from serve.engine.core import EngineOptions

SMALL = dict(k_policy="schedule", max_concurrency=2, max_queue=16, queue_timeout_s=30.0)


def small_options(**kw) -> EngineOptions:
    return EngineOptions(**{**SMALL, **kw})


def stream_all(eng, prompts, params) -> list:
    """Stream every request at once (one batch), each with its own GenerationParams; their results."""
    async def one(p, gp):
        s = eng.stream(p, gp)
        async for _ in s:
            pass
        return s.result

    async def run():
        return await asyncio.gather(*[one(p, gp) for p, gp in zip(prompts, params)])

    return asyncio.run(run())
