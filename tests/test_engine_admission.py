"""The engine under more requests than KV slots: queued streams finish, a full queue is refused,
and a request cancelled while queued or mid-step never leaks its slot (issue 18, defects 1-2)."""

import asyncio
import threading
import time

import pytest

from infra.target import build_tiny_llama
from serve.engine.admission import Overloaded
from serve.spec_decode.specs import build_draft
from serve.engine.core import GenerationParams, SpecEngine
from engine_options import small_options

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def target():
    m = build_tiny_llama(seed=0, num_layers=2, max_positions=128)
    m.config.eos_token_id = None
    return m


def engine(target, **kw) -> SpecEngine:
    return SpecEngine(target, build_draft("truncate:1", target), options=small_options(k=3, max_seq_len=64, **kw))


async def run_stream(eng: SpecEngine, prompt: list[int], n: int = 12) -> list[int]:
    stream = eng.stream(prompt, GenerationParams(max_new_tokens=n))
    return [t async for chunk in stream for t in chunk]


def test_more_streams_than_slots_all_finish_without_extra_threads(target):
    """16 streams on 2 slots: before the fix each waiter parked a worker thread and 7 deadlocked."""
    eng = engine(target, max_concurrency=2, max_queue=16)
    prompts = [[i + 1, i + 2, i + 3] for i in range(16)]
    solo = [eng.generate(p, GenerationParams(max_new_tokens=12)).output_ids for p in prompts]

    async def all_of_them():
        threads = threading.active_count()
        tasks = [asyncio.create_task(run_stream(eng, p)) for p in prompts]
        await asyncio.sleep(0.05)
        assert threading.active_count() <= threads + 1  # the engine's one stepping thread
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    outs = asyncio.run(all_of_them())
    assert outs == solo
    assert eng.slots.free == 2
    eng.slots.check()


def test_full_queue_is_refused_at_once(target):
    eng = engine(target, max_concurrency=1, max_queue=1)

    async def run():
        first = asyncio.create_task(run_stream(eng, [1, 2, 3], n=30))
        second = asyncio.create_task(run_stream(eng, [4, 5, 6], n=5))
        # A few loop turns, not a wall-clock sleep: the first stream takes the slot and the
        # second the one queue place; the driver steps once a turn (at most 4 tokens), so the
        # first is still running. A 10 ms sleep let a fast machine finish both first.
        for _ in range(3):
            await asyncio.sleep(0)
        assert eng.slots.free == 0
        with pytest.raises(Overloaded):
            await run_stream(eng, [7, 8, 9], n=5)
        return await asyncio.gather(first, second)

    a, b = asyncio.run(run())
    assert len(a) == 30 and len(b) == 5
    assert eng.slots.free == 1 and eng.slots.rejected == 1


def test_cancelled_requests_never_leak_slots(target):
    """Cancel requests while queued and while stepping, many times over: every slot comes back,
    and a normal request still runs (before the fix two cancellations left nothing to serve)."""
    eng = engine(target, max_concurrency=2, max_queue=8)

    async def run():
        for _ in range(5):
            tasks = [asyncio.create_task(run_stream(eng, [i + 1, i + 2], n=40)) for i in range(6)]
            await asyncio.sleep(0.02)  # two are stepping, four are queued
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(200):  # a step cancelled mid-forward returns its slot when it ends
            if eng.slots.free == 2:
                break
            await asyncio.sleep(0.01)
        return await asyncio.wait_for(run_stream(eng, [3, 4, 5], n=6), 30)

    out = asyncio.run(run())
    assert len(out) == 6
    assert eng.slots.free == 2 and eng.slots.queued == 0
    eng.slots.check()


def test_abandoned_admission_returns_the_slot(target):
    eng = engine(target, max_concurrency=1)

    async def run():
        stream = eng.stream([1, 2, 3], GenerationParams(max_new_tokens=4))
        await stream.admit()
        assert eng.slots.free == 0
        stream.abandon()  # the client went away between admission and the first token

    asyncio.run(run())
    assert eng.slots.free == 1


def test_health_reports_a_stalled_request(target):
    """A step that hangs, on the thread that drives it; health is asked from another."""
    eng = engine(target, max_concurrency=1)
    gate = threading.Event()
    schedule = eng.scheduler.schedule
    eng.scheduler.schedule = lambda: (schedule(), gate.wait(10))[0]  # the driving thread hangs in a step
    out = []
    driver = threading.Thread(target=lambda: out.append(eng.generate([1, 2, 3], GenerationParams(max_new_tokens=4))))
    driver.start()
    time.sleep(0.3)
    eng.check_health(stall_timeout_s=5)  # a young stall is fine
    with pytest.raises(RuntimeError, match="no progress"):
        eng.check_health(stall_timeout_s=0.1)
    gate.set()
    driver.join(30)
    assert len(out[0].output_ids) == 4
    eng.check_health(stall_timeout_s=0.1)  # nothing running: healthy again
