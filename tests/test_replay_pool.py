"""The replay pool: recent records with a share of warm-start ones, shuffled, seeded."""

import random

import pytest

from train.online.replay import replay_pool

pytestmark = pytest.mark.pure


def test_no_fraction_replays_only_recent_records_shuffled():
    recent = list(range(10))
    pool = replay_pool(recent, ["w"] * 5, 0.0, random.Random(0))
    assert sorted(pool) == recent and pool != recent


def test_warm_records_make_up_the_fraction_of_the_pool():
    recent = [("r", i) for i in range(30)]
    warm = [("w", i) for i in range(100)]
    pool = replay_pool(recent, warm, 0.5, random.Random(1))
    assert sum(1 for k, _ in pool if k == "w") == 30 and len(pool) == 60
    assert len(set(pool)) == 60  # no record twice
    pool = replay_pool(recent, warm, 0.25, random.Random(1))
    assert sum(1 for k, _ in pool if k == "w") == 10


def test_the_pool_is_limited_by_the_warm_records_there_are_and_seeded():
    pool = replay_pool(list(range(10)), ["a", "b"], 0.9, random.Random(2))
    assert pool.count("a") == 1 and pool.count("b") == 1
    assert replay_pool(list(range(10)), list("abcdef"), 0.5, random.Random(3)) == \
        replay_pool(list(range(10)), list("abcdef"), 0.5, random.Random(3))


def test_bad_fraction_is_refused():
    with pytest.raises(ValueError):
        replay_pool([1], [2], 1.0, random.Random(0))
