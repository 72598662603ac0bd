"""How many threads a small native forward takes (serve/model/native_threads.py): measured once
per runner kind, one thread kept only where it is nearly as fast as all of them. The step is a
fake that advances a fake clock, so the rule is tested, not this machine."""

import pytest

from serve.model import native_threads
from serve.model.native_threads import MEASURE_MIN_BYTES, SMALL_FORWARD_ROWS, small_forward_rows

pytestmark = [pytest.mark.pure]

BIG = MEASURE_MIN_BYTES


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.slept = 0.0

    def perf_counter(self):
        return self.now

    def sleep(self, s):
        self.slept += s


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(native_threads, "time", c)
    monkeypatch.setattr(native_threads, "_decided", {})
    return c


def stepper(clock, ms_by_threads):
    calls = []

    def step(n):
        calls.append(n)
        clock.now += ms_by_threads[n] / 1e3

    return step, calls


def test_one_thread_is_kept_where_one_core_streams_nearly_as_fast(clock):
    step, calls = stepper(clock, {1: 3.5, 2: 3.1})  # within the slack
    assert small_forward_rows(("a",), BIG, 2, step) == SMALL_FORWARD_ROWS
    assert calls.count(1) == calls.count(2) == 1 + native_threads.REPEATS
    assert clock.slept >= native_threads.SETTLE_S


def test_every_thread_serves_small_forwards_where_one_core_streams_far_less(clock):
    step, _ = stepper(clock, {1: 11.6, 2: 5.8})
    assert small_forward_rows(("b",), BIG, 2, step) == 0


def test_the_rule_is_measured_once_per_key(clock):
    step, calls = stepper(clock, {1: 11.6, 4: 5.8})
    assert small_forward_rows(("c",), BIG, 4, step) == 0
    n = len(calls)
    assert small_forward_rows(("c",), BIG, 4, step) == 0
    assert len(calls) == n
    assert native_threads.decided() == {("c",): 0}


@pytest.mark.parametrize("threads,size", [(1, BIG), (2, BIG - 1)])
def test_one_thread_or_tiny_weights_are_not_measured(clock, threads, size):
    step, calls = stepper(clock, {1: 100.0, 2: 1.0})
    assert small_forward_rows(("d",), size, threads, step) == SMALL_FORWARD_ROWS
    assert calls == []


def test_the_step_of_a_real_runner_is_a_one_row_forward_on_n_threads():
    class Runner:
        def __init__(self):
            self.seen = []

        def new_cache(self):
            return type("Cache", (), {"length": 7})()

        def forward_rows_on(self, items, threads):
            (it,) = items
            self.seen.append((tuple(it.tokens.shape), it.cache.length, threads))

    r = Runner()
    step = native_threads.measure_step(r)
    step(2)
    step(1)
    assert r.seen == [((1,), 0, 2), ((1,), 0, 1)]
