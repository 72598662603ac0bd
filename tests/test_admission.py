"""The KV-slot pool: bounded queue, bounded wait, no slot lost to a cancelled or timed-out waiter."""

import asyncio
import threading

import pytest

from serve.engine.admission import Overloaded, QueueTimeout, SlotPool

pytestmark = pytest.mark.pure


def test_free_slots_are_taken_at_once_and_returned():
    pool = SlotPool(["a", "b"], max_queue=0, timeout_s=1)

    async def run():
        a = await pool.acquire()
        b = await pool.acquire()
        assert {a, b} == {"a", "b"} and pool.free == 0 and pool.in_use == 2
        with pytest.raises(Overloaded):  # no queue at all: the third is refused at once
            await pool.acquire()
        pool.release(a)
        pool.release(b)

    asyncio.run(run())
    assert pool.free == 2 and pool.in_use == 0 and pool.rejected == 1
    pool.check()


def test_many_waiters_park_no_thread_and_are_served_in_order():
    """The deadlock of issue 18: waiters used to park pool threads. 50 waiters, 1 slot, and the
    thread count stays where it was."""
    pool = SlotPool(["s"], max_queue=64, timeout_s=5)
    order: list[int] = []

    async def worker(i: int):
        slot = await pool.acquire()
        order.append(i)
        await asyncio.sleep(0)
        pool.release(slot)

    async def run():
        threads = threading.active_count()
        tasks = [asyncio.create_task(worker(i)) for i in range(50)]
        await asyncio.sleep(0)
        assert threading.active_count() == threads
        await asyncio.gather(*tasks)

    asyncio.run(run())
    assert order == list(range(50))
    assert pool.free == 1
    pool.check()


def test_queue_is_bounded():
    pool = SlotPool(["s"], max_queue=2, timeout_s=5)

    async def run():
        held = await pool.acquire()
        waiters = [asyncio.create_task(pool.acquire()) for _ in range(2)]
        await asyncio.sleep(0)
        assert pool.queued == 2
        with pytest.raises(Overloaded, match="queued"):
            await pool.acquire()
        pool.release(held)
        first = await waiters[0]
        pool.release(first)
        pool.release(await waiters[1])

    asyncio.run(run())
    assert pool.free == 1 and pool.rejected == 1
    pool.check()


def test_wait_is_bounded_in_time():
    pool = SlotPool(["s"], max_queue=4, timeout_s=0.05)

    async def run():
        held = await pool.acquire()
        with pytest.raises(QueueTimeout):
            await pool.acquire()
        assert pool.queued == 0  # the timed-out waiter left the queue
        pool.release(held)

    asyncio.run(run())
    assert pool.free == 1 and pool.timed_out == 1
    pool.check()


def test_cancelled_waiter_leaks_nothing():
    """A client that goes away while queued: its slot is neither taken later nor lost."""
    pool = SlotPool(["s"], max_queue=4, timeout_s=5)

    async def run():
        held = await pool.acquire()
        waiter = asyncio.create_task(pool.acquire())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert pool.queued == 0
        pool.release(held)

    asyncio.run(run())
    assert pool.free == 1 and pool.in_use == 0
    pool.check()


def test_cancel_racing_a_handover_returns_the_slot():
    """The release picks the waiter, then the waiter is cancelled before it runs: the handed
    slot must come back to the pool, not vanish with the cancelled request."""
    pool = SlotPool(["s"], max_queue=4, timeout_s=5)

    async def run():
        held = await pool.acquire()
        waiter = asyncio.create_task(pool.acquire())
        await asyncio.sleep(0)
        pool.release(held)  # hands the slot to the waiter (delivery scheduled on the loop)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.sleep(0)  # let a scheduled delivery run

    asyncio.run(run())
    assert pool.free == 1 and pool.in_use == 0
    pool.check()


def test_blocking_and_async_waiters_share_the_pool():
    pool = SlotPool(["s"], max_queue=4, timeout_s=5)
    got = []

    async def run():
        held = await pool.acquire()
        t = threading.Thread(target=lambda: got.append(pool.acquire_blocking()))
        t.start()
        while pool.queued == 0:
            await asyncio.sleep(0.001)
        pool.release(held)
        await asyncio.to_thread(t.join, 5)

    asyncio.run(run())
    assert got == ["s"] and pool.in_use == 1
    pool.release("s")
    pool.check()


def test_blocking_wait_times_out():
    pool = SlotPool(["s"], max_queue=4, timeout_s=0.05)
    held = pool.acquire_blocking()
    with pytest.raises(QueueTimeout):
        pool.acquire_blocking()
    pool.release(held)
    assert pool.free == 1 and pool.queued == 0


def test_accounting_check_catches_a_double_release():
    pool = SlotPool(["s"], max_queue=0, timeout_s=1)
    pool.release(pool.acquire_blocking())
    pool.release("s")
    with pytest.raises(RuntimeError, match="accounting"):
        pool.check()
