"""`osd train` through a Redis outage: the group is started again with a doubling back-off for
train.retry_for_s, so a 30 s outage does not end standalone training (it used to after two
quick retries), and a longer one ends it with a clear error."""

import pytest
import ray.exceptions as rex

from infra.config import load_config
from train.online import trainer

pytestmark = pytest.mark.pure


class _Clock:
    def __init__(self):
        self.t = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def _group(clock: _Clock, outage_s: float, starts: list):
    """A trainer group whose start fails (as setup does when Redis is away) until outage_s."""

    class Group:
        def __init__(self, *a, **k):
            starts.append(clock.t)
            clock.t += 1.0  # a start takes a while
            if clock.t < outage_s:
                raise rex.RayTaskError("setup", "tb", ConnectionError("Error 111 connecting to redis"))

        def run(self, **kw):
            return ["stats"]

        def shutdown(self):
            pass

    return Group


def test_a_30_s_outage_does_not_end_training(tmp_path, monkeypatch):
    clock, starts = _Clock(), []
    monkeypatch.setattr(trainer, "TrainerGroup", _group(clock, 30.0, starts))
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    out = trainer.run_with_restarts(cfg, tmp_path / "run", sleep=clock.sleep, clock=clock)
    assert out == ["stats"] and len(starts) >= 4
    assert clock.slept == sorted(clock.slept) and clock.slept[0] < clock.slept[-1]  # backing off


def test_an_outage_past_retry_for_s_ends_training_with_a_clear_error(tmp_path, monkeypatch):
    clock, starts = _Clock(), []
    monkeypatch.setattr(trainer, "TrainerGroup", _group(clock, 1e9, starts))
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path), "train": {"retry_for_s": 60}})
    with pytest.raises(RuntimeError, match="training failed"):
        trainer.run_with_restarts(cfg, tmp_path / "run", sleep=clock.sleep, clock=clock)
    assert clock.t <= 60 + 2 + 30  # bounded: the budget, one start, at most one back-off step
