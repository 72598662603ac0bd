"""The trainer's own reads (short while it holds a batch, longer when idle) stay shorter than
the configured socket timeout: a stream.socket_timeout_s the config accepts (0.5 s, with
block_ms 200) used to fail every trainer start with "block_ms (500) must be shorter than
socket_timeout_s", and `osd up` restarted it for ever (found by test_stack.py)."""

import pytest

from infra.config import load_config
from infra.records.streams import RecordConsumer
from train.online.trainer import TrainerWorker

pytestmark = pytest.mark.redis


@pytest.mark.parametrize("holding", [False, True])
def test_a_short_socket_timeout_the_config_accepts_does_not_fail_the_trainer_s_read(redis_url, holding):
    cfg = load_config(environ={}, overrides={"stream": {"redis_url": redis_url, "stream": "f:trainer-read",
                                                        "socket_timeout_s": 0.5, "block_ms": 200}})
    worker = object.__new__(TrainerWorker)  # _fill needs only its config, consumer and buffers
    worker.cfg, worker.world_size, worker.held_out, worker._held_acks = cfg, 1, [], []
    worker.trained_prompts = {}
    worker.consumer = RecordConsumer(redis_url, cfg.stream)
    try:
        # what run() asks for: 100 ms while it holds a batch, 500 ms when idle
        assert worker._fill(["a delivery held"] if holding else [], block_ms=100 if holding else 500) == 0
    finally:
        worker.consumer.close()
