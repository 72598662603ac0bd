"""Checkpoints are pruned to train.keep_checkpoints once a newer one is COMPLETE (they share a
volume with the registry in the chart): never the one being written, never the newest
COMPLETE ones, and a killed run's half-written tags go too."""

import pytest

from train.distill.ds_engine import COMPLETE, DistillEngine, prune_checkpoints

pytestmark = pytest.mark.pure


def _tag(d, step, complete=True):
    t = d / f"step-{step:08d}"
    t.mkdir(parents=True)
    (t / "mp_rank_00_model_states.pt").write_bytes(b"x" * 1000)
    if complete:
        (t / COMPLETE).write_text("{}")
    return t.name


def test_prune_keeps_the_newest_complete_and_the_one_being_written(tmp_path):
    d = tmp_path / "checkpoints"
    torn = _tag(d, 1, complete=False)  # a run killed mid-save
    done = [_tag(d, s) for s in (2, 3, 4, 5)]
    writing = _tag(d, 6, complete=False)
    assert prune_checkpoints(d, 3) == [torn, done[0]]
    assert DistillEngine.complete_tags(d) == done[1:]
    assert (d / writing).is_dir()


def test_disk_stays_bounded_over_many_saves(tmp_path):
    d = tmp_path / "checkpoints"
    for step in range(1, 30):
        _tag(d, step)
        prune_checkpoints(d, 3)
        assert len(list(d.iterdir())) <= 3
    assert DistillEngine.complete_tags(d)[-1] == "step-00000029"



def test_a_full_disk_while_marking_complete_leaves_a_tag_that_is_never_resumed(tmp_path, monkeypatch):
    import errno
    import os

    from infra.common.durable import write_durable

    d = tmp_path / "checkpoints"
    good = _tag(d, 1)
    torn = _tag(d, 2, complete=False)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", full)
        with pytest.raises(OSError):
            write_durable(d / torn / COMPLETE, b"{}")
    assert sorted(p.name for p in (d / torn).iterdir()) == ["mp_rank_00_model_states.pt"]  # no marker, no temp
    assert DistillEngine.complete_tags(d) == [good]  # a resume takes the last whole one
    _tag(d, 3)  # space again: the next checkpoint completes, and the torn one goes
    assert prune_checkpoints(d, 3) == [torn]
