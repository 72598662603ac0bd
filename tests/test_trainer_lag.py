"""The trainer's lag bound (train/online/lag.py): stale records are skipped but a fixed share, the
same share on every call; nothing is stale with the bound off."""

import uuid

import pytest

from train.online import lag
from train.online.lag import is_stale, keep_stale, train_on


def _delivery(i: int, created_at: float, n: int = 4):
    """A delivery of record r<i> with `n` output tokens (a prompt of 2), created at `created_at`."""
    import numpy as np

    from infra.records.schema import Record
    from infra.records.streams import Delivery

    rec = Record(request_id=f"r{i}", draft_version="v1", prompt_ids=np.array([3, i], np.int32),
                 output_ids=np.full(n, 5, np.int32), topk_ids=np.zeros((n, 2), np.int32),
                 topk_logprobs=np.zeros((n, 2), np.float16), accepted=np.zeros(n, bool),
                 draft_tokens=np.full(n, -1, np.int32), draft_probs=np.zeros(n, np.float32),
                 created_at=created_at)
    return Delivery(f"{i}-0", rec)


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


@pytest.mark.pure
def test_the_trainer_skips_records_past_the_bound_acks_them_with_the_checkpoint_and_counts_them(tmp_path, monkeypatch):
    """TrainerWorker._fill with a consumer that hands it fresh and stale records (no Redis)."""
    import time
    from types import SimpleNamespace

    from infra.config import load_config
    from train.online.trainer import TrainerWorker

    now = time.time()

    def delivery(i, age):
        return _delivery(i, now - age)

    got = [delivery(i, 300.0 if i % 2 else 1.0) for i in range(40)]
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path), "model": {"target": "tiny-random"},
                                             "train": {"max_lag_s": 60.0, "held_out_every": 1_000_000}})
    monkeypatch.setattr(lag, "STALE_KEEP", 0.25)
    w = TrainerWorker(cfg.model_dump(mode="json"), 0, 1, str(tmp_path / "run"))
    w.consumer = SimpleNamespace(read=lambda count=None, block_ms=None: got)
    w.telemetry = SimpleNamespace(status={})
    w.held_out, w.trained_prompts = [], {}
    buffer: list = []
    assert w._fill(buffer, block_ms=0) == 40
    stale = [d for d in got if now - d.record.created_at > 60]
    kept = [d for d in stale if keep_stale(d.record.record_id, 0.25)]
    assert 0 < len(kept) < len(stale)
    assert {d.entry_id for d in buffer} == {d.entry_id for d in got if d not in stale} | {d.entry_id for d in kept}
    assert {d.entry_id for d in w._held_acks} == {d.entry_id for d in stale if d not in kept}  # acked, not trained
    assert w.skipped_stale == w.telemetry.status["skipped_stale"] == len(stale) - len(kept)


def test_a_trainer_behind_reads_on_through_whole_reads_of_stale_records_in_one_fill(tmp_path, monkeypatch):
    """A backlog of stale records is read past in one fill (up to FILL_BUDGET_S), not one read per
    training step: the trainer's lag then stays near train.max_lag_s however far it fell behind."""
    import time
    from types import SimpleNamespace

    from infra.config import load_config
    from train.online import trainer
    from train.online.trainer import TrainerWorker

    now = time.time()

    def delivery(i, age):
        return _delivery(i, now - age)

    monkeypatch.setattr(lag, "STALE_KEEP", 0.0)
    monkeypatch.setattr(trainer, "READ_COUNT", 4)
    reads = [[delivery(4 * r + i, 300.0) for i in range(4)] for r in range(5)]  # 5 full reads, all stale
    reads.append([delivery(100, 1.0), delivery(101, 1.0), delivery(102, 1.0), delivery(103, 1.0)])  # caught up
    reads.append([delivery(200, 1.0)] * 4)  # never reached: a read without stale records ends the fill
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path), "model": {"target": "tiny-random"},
                                             "train": {"max_lag_s": 60.0, "held_out_every": 1_000_000}})
    w = TrainerWorker(cfg.model_dump(mode="json"), 0, 1, str(tmp_path / "run"))
    w.consumer = SimpleNamespace(read=lambda count=None, block_ms=None: reads.pop(0))
    w.telemetry = SimpleNamespace(status={})
    w.held_out, w.trained_prompts = [], {}
    buffer: list = []
    assert w._fill(buffer, block_ms=0) == 24
    assert [d.entry_id for d in buffer] == ["100-0", "101-0", "102-0", "103-0"] and w.skipped_stale == 20
    assert len(reads) == 1
    # The stale share kept for training does not stop the reading on: it is still a backlog.
    monkeypatch.setattr(lag, "STALE_KEEP", 1.0)
    reads[:] = [[delivery(300 + i, 300.0) for i in range(4)], [delivery(400, 1.0)]]
    assert w._fill(buffer, block_ms=0) == 5 and not reads


def test_records_that_went_stale_in_the_buffer_and_those_beyond_its_bound_are_shed(tmp_path, monkeypatch):
    import time
    from types import SimpleNamespace

    from infra.config import load_config
    from train.online import trainer
    from train.online.trainer import TrainerWorker

    now = time.time()

    def delivery(i, age):
        return _delivery(i, now - age, 8)

    monkeypatch.setattr(lag, "STALE_KEEP", 0.0)
    monkeypatch.setattr(trainer, "BUFFER_BATCHES", 2)
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path), "model": {"target": "tiny-random"},
                                             "train": {"max_lag_s": 60.0, "token_budget": 30}})
    w = TrainerWorker(cfg.model_dump(mode="json"), 0, 1, str(tmp_path / "run"))
    w.telemetry = SimpleNamespace(status={})
    buffer = [delivery(0, 90.0)] + [delivery(i, 1.0) for i in range(1, 10)]  # 10 tokens each
    w._shed(buffer)
    # the stale one goes, then the oldest beyond 2 budgets (60 tokens): the newest 6 stay, in order
    assert [d.entry_id for d in buffer] == [f"{i}-0" for i in range(4, 10)]
    assert w.skipped_stale == 4 and len(w._held_acks) == 4 and w.telemetry.status["skipped_stale"] == 4
    w._shed(buffer)
    assert w.skipped_stale == 4  # nothing more to shed
    # Without a lag bound nothing is shed, however full the buffer.
    w.cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path), "model": {"target": "tiny-random"},
                                               "train": {"max_lag_s": 0.0, "token_budget": 10}})
    w._shed(buffer)
    assert len(buffer) == 6 and w.skipped_stale == 4
