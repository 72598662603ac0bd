"""The trainer's lag bound (train/lag.py): stale records are skipped but a fixed share, the
same share on every call; nothing is stale with the bound off."""

import uuid

import pytest

from train.lag import is_stale, keep_stale, train_on


@pytest.mark.pure
def test_only_records_older_than_the_bound_are_stale_and_a_zero_bound_keeps_all():
    assert not is_stale(100.0, 130.0, 30.0) and is_stale(100.0, 130.5, 30.0)
    assert not is_stale(0.0, 1e9, 0.0)
    assert train_on("r", 0.0, 1e9, 0.0, 0.0)  # bound off: everything is trained on, in order


@pytest.mark.pure
def test_the_stale_share_kept_is_the_configured_one_and_fixed_per_record():
    ids = [str(uuid.UUID(int=i, version=4)) for i in range(20_000)]
    kept = [keep_stale(i, 0.1) for i in ids]
    assert abs(sum(kept) / len(ids) - 0.1) < 0.01
    assert kept == [keep_stale(i, 0.1) for i in ids]  # the same records on every rank and restart
    assert not any(keep_stale(i, 0.0) for i in ids[:1000]) and all(keep_stale(i, 1.0) for i in ids[:1000])
    fresh_and_stale = [train_on(i, 100.0, 200.0, 30.0, 0.1) for i in ids]
    assert fresh_and_stale == kept and all(train_on(i, 190.0, 200.0, 30.0, 0.1) for i in ids[:1000])
