"""The native forward's thread pool (serve/model/native/pool.h): every item of every phase runs
exactly once, with more threads than cores (so the OS takes workers off their cores mid-phase),
in phases of a few items, of more items than threads, and of more than one turn's worth."""

import ctypes

import pytest

from native_builds import BUILDS, load_build

pytestmark = [pytest.mark.pure]


def pool_check(build: str):
    fn = load_build(build).osd_pool_check
    fn.restype = ctypes.c_int32
    fn.argtypes = (ctypes.c_int32,) * 4
    return fn


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("threads", [2, 3, 5])
def test_every_item_runs_once_per_phase(build, threads):
    check = pool_check(build)
    assert check(threads, 3000, 0, 40) == 0
    assert check(threads, 200, 100, 2000) == 0


@pytest.mark.parametrize("build", BUILDS[:1])
def test_a_phase_past_one_turns_count_runs_every_item_once(build):
    # A slot counts up to 2**20 - 1 items; longer phases run in turns.
    assert pool_check(build)(2, 2, (1 << 20) + 3, (1 << 20) + 50) == 0
