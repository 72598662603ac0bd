"""Admission control: a fixed set of KV slots and a bounded, cancellable wait for one.

A request needs one slot (its preallocated KV caches) for its whole life. When none is
free it waits, but never by parking a thread: an async waiter is an asyncio future that a
release completes, so 100 queued requests cost 100 futures, not 100 worker threads (the
replica's thread pool is also what running requests step in, so parked threads used to
deadlock it). The wait is bounded twice:
- in length: past `max_queue` waiters a request is refused at once (`Overloaded`, 429);
- in time: a waiter that gets no slot within `timeout_s` gives up (`QueueTimeout`, 503).

A slot handed to a waiter that was cancelled in the meantime goes back to the pool, so a
client that disconnects while queued never leaks capacity.

Blocking callers (SpecEngine.generate from a plain thread) use `acquire_blocking()`, which
takes a free slot or waits on a condition; they and async waiters share one FIFO.
No framework imports: unit-tested without torch or Ray.
"""

from __future__ import annotations

import asyncio
import collections
import math
import threading
from typing import Any, Generic, Iterable, TypeVar

T = TypeVar("T")


class Overloaded(RuntimeError):
    """Every slot is busy and the queue is full: try again later (HTTP 429)."""


class QueueTimeout(RuntimeError):
    """No slot became free within the queue timeout (HTTP 503)."""


class _Waiter:
    __slots__ = ("loop", "future", "event", "slot")

    def __init__(self, loop: asyncio.AbstractEventLoop | None):
        self.loop = loop
        self.future: asyncio.Future | None = loop.create_future() if loop is not None else None
        self.event = threading.Event() if loop is None else None
        self.slot: Any = None


class SlotPool(Generic[T]):
    def __init__(self, slots: Iterable[T], max_queue: int, timeout_s: float):
        self._free: collections.deque[T] = collections.deque(slots)
        self.total = len(self._free)
        if self.total < 1:
            raise ValueError("a slot pool needs at least one slot")
        if max_queue < 0 or timeout_s <= 0:
            raise ValueError("max_queue must be >= 0 and timeout_s > 0")
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._lock = threading.Lock()
        self.in_use = 0
        self.rejected = 0
        self.timed_out = 0

    # -- state ---------------------------------------------------------------------

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def idle(self) -> list[T]:
        """The free slots now (a snapshot: a request may take one at any time)."""
        with self._lock:
            return list(self._free)

    def check(self) -> None:
        """Raise if the slot count does not add up (a leak or a double release)."""
        with self._lock:
            free, in_use = len(self._free), self.in_use
        if free + in_use != self.total or in_use < 0:
            raise RuntimeError(f"slot accounting is off: {free} free + {in_use} in use != {self.total} slots")

    # -- taking a slot ---------------------------------------------------------------

    def _take_or_enqueue(self, loop: asyncio.AbstractEventLoop | None) -> tuple[T | None, _Waiter | None]:
        with self._lock:
            if self._free and not self._waiters:
                self.in_use += 1
                return self._free.popleft(), None
            if len(self._waiters) >= self.max_queue:
                self.rejected += 1
                raise Overloaded(f"all {self.total} slots are busy and {len(self._waiters)} requests are queued")
            waiter = _Waiter(loop)
            self._waiters.append(waiter)
            return None, waiter

    def _abandon(self, waiter: _Waiter) -> bool:
        """Take a waiter out of the queue; False if a release already handed it a slot."""
        with self._lock:
            try:
                self._waiters.remove(waiter)
                return True
            except ValueError:
                return False

    async def acquire(self) -> T:
        slot, waiter = self._take_or_enqueue(asyncio.get_running_loop())
        if waiter is None:
            return slot  # type: ignore[return-value]
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), self.timeout_s)
        except BaseException as e:  # timeout, cancellation (client gone), or anything else
            if not self._abandon(waiter):
                # A release already chose this waiter: the slot is ours (or on its way) and
                # must go back, or it would leak with the request.
                self._return_handed_slot(waiter)
            if isinstance(e, asyncio.TimeoutError):
                with self._lock:
                    self.timed_out += 1
                raise QueueTimeout(f"no KV slot became free within {self.timeout_s:g} s") from None
            raise

    def _return_handed_slot(self, waiter: _Waiter) -> None:
        fut = waiter.future
        if fut is not None and fut.done() and not fut.cancelled():
            self.release(fut.result())
        else:  # delivery is scheduled on the loop but has not run: it will see the flag
            waiter.slot = _ABANDONED

    def acquire_blocking(self) -> T:
        slot, waiter = self._take_or_enqueue(None)
        if waiter is None:
            return slot  # type: ignore[return-value]
        if waiter.event.wait(self.timeout_s):  # type: ignore[union-attr]
            return waiter.slot
        if self._abandon(waiter):
            with self._lock:
                self.timed_out += 1
            raise QueueTimeout(f"no KV slot became free within {self.timeout_s:g} s")
        waiter.event.wait()  # type: ignore[union-attr]  # a release picked us just now: it is set
        return waiter.slot

    # -- giving it back ---------------------------------------------------------------

    def release(self, slot: T) -> None:
        with self._lock:
            waiter = self._waiters.popleft() if self._waiters else None
            if waiter is None:
                self.in_use -= 1
                self._free.append(slot)
                return
        # Handed over directly: in_use is unchanged (one request leaves, one enters).
        if waiter.loop is None:
            waiter.slot = slot
            waiter.event.set()  # type: ignore[union-attr]
            return
        try:
            waiter.loop.call_soon_threadsafe(self._deliver, waiter, slot)
        except RuntimeError:  # the waiter's loop is closed: nobody will take it
            self.release(slot)

    def _deliver(self, waiter: _Waiter, slot: T) -> None:
        fut = waiter.future
        if waiter.slot is _ABANDONED or fut is None or fut.done():
            self.release(slot)
        else:
            fut.set_result(slot)


_ABANDONED: Any = object()


def retry_after_s(pool: SlotPool, service_s: float) -> int:
    """A Retry-After hint: the time for the queue ahead to drain, at least 1 s. Requests finish
    at `total / service_s` a second (service_s: the mean time from admission to finish, which
    time spent queued does not inflate), and a retry is served at once when the requests
    queued now have all started."""
    return max(1, math.ceil(pool.queued * service_s / pool.total))
