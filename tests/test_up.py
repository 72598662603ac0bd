"""`osd up`'s trainer supervision: restarts with a capped exponential back-off, never giving up."""

import threading

import pytest

from pipeline.stack.up import restart_delay, supervise

pytestmark = [pytest.mark.pure]


class FlakyTrainer:
    """Fails `n` times (as a Redis outage would surface), then runs to the end."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def __call__(self):
        self.calls += 1
        if self.calls <= self.n:
            raise ConnectionError(f"Error 111 connecting to 127.0.0.1:6379 (call {self.calls})\nConnection refused.")


def test_restart_delay_doubles_and_is_capped():
    assert [restart_delay(i, 1.0, 60.0) for i in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert restart_delay(10_000, 1.0, 60.0) == 60  # no overflow however long the outage


def test_a_trainer_that_fails_many_times_is_restarted_until_it_works():
    trainer, waits, logs = FlakyTrainer(8), [], []
    stopping = threading.Event()
    restarts = supervise(trainer, stopping, base_s=1.0, cap_s=30.0,
                         wait=lambda s: waits.append(s) or False, clock=lambda: 0.0, log=logs.append)
    assert restarts == 8 and trainer.calls == 9  # more than the 5 restarts `up` used to allow
    assert waits == [1, 2, 4, 8, 16, 30, 30, 30]
    assert len(logs) == 8 and all("ConnectionError: Connection refused." in line for line in logs)
    assert "restart 8 in 30 s" in logs[-1]


def test_a_run_that_was_healthy_for_a_while_starts_the_back_off_over():
    trainer, waits = FlakyTrainer(4), []
    # clock() at each run's start and failure: the third run lasts 100 s before it fails
    times = iter([0, 0, 0, 0, 0, 100, 100, 100, 100])
    supervise(trainer, threading.Event(), base_s=1.0, cap_s=30.0, wait=lambda s: waits.append(s) or False,
              clock=lambda: next(times), log=lambda m: None)
    assert waits == [1, 2, 1, 2]


def test_stopping_during_the_back_off_ends_supervision_without_another_start():
    trainer, stopping = FlakyTrainer(100), threading.Event()

    def wait(seconds):
        stopping.set()
        return True

    assert supervise(trainer, stopping, wait=wait, log=lambda m: None) == 0
    assert trainer.calls == 1


def test_closed_loop_keeps_restarting_its_trainer_group(tmp_path, monkeypatch):
    """ClosedLoop's trainer thread with a fake group: failed groups are shut down and replaced."""
    import train.online.trainer
    import pipeline.stack.up as up
    from infra.config import load_config

    made, shut = [], []

    class FakeGroup:
        n = 1

        def __init__(self, cfg, run_dir, init_draft=None, served=None):
            made.append(init_draft)
            if len(made) <= 2:
                raise ConnectionError("Redis went away during setup")

        def run(self):
            if len(made) <= 7:
                raise ConnectionError("Redis went away during training")

        def shutdown(self):
            shut.append(len(made))

    monkeypatch.setattr(train.online.trainer, "TrainerGroup", FakeGroup)
    monkeypatch.setattr(up, "RESTART_BASE_S", 0.0)  # back-off of 0 s: the sequence, not the waiting, is tested
    loop = up.ClosedLoop(load_config(environ={}, overrides={"state_dir": str(tmp_path)}), run_name="t")
    loop._start_trainer("v1")
    loop._trainer_thread.join(timeout=60)
    assert not loop._trainer_thread.is_alive()
    assert made == ["registry:v1"] * 8  # 7 failures, then a run that ended on its own
    assert shut == [3, 4, 5, 6, 7, 8]  # every group that was built was shut down, the last one included
    assert loop.trainer_error == "ConnectionError: Redis went away during training"
