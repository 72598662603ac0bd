"""A replica's process ends with records still queued in its producer: on an ordinary exit
they are written (an atexit close), on SIGKILL at most the records of one write batch in
flight are lost, because the writer sends each record as soon as it is queued."""

import subprocess
import sys

import pytest
import redis

from tests.faults.conftest import ROOT

pytestmark = pytest.mark.redis

_PRODUCE = """
import os, signal, sys, time
import numpy as np
from infra.config import StreamConfig
from infra.records.schema import Record
from infra.records.streams import RecordProducer
url, n, pause, end = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
p = RecordProducer(url, StreamConfig(stream="f:exit", lag_budget=0))
k = 8
for i in range(n):
    p.submit(Record(request_id=f"r{i}", draft_version="v1", prompt_ids=np.arange(4, dtype=np.int32),
                    output_ids=np.full(k, 5, np.int32), topk_ids=np.zeros((k, 2), np.int32),
                    topk_logprobs=np.zeros((k, 2), np.float16), accepted=np.zeros(k, bool),
                    draft_tokens=np.full(k, -1, np.int32), draft_probs=np.zeros(k, np.float32)))
    time.sleep(pause)
if end == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(0)  # no close(): what the interpreter's exit does with the queue
"""


def _run(url: str, n: int, pause: float, end: str) -> int:
    subprocess.run([sys.executable, "-c", _PRODUCE, url, str(n), str(pause), end], cwd=ROOT, timeout=60,
                   env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    return redis.Redis.from_url(url).xlen("f:exit")


def test_records_queued_at_exit_are_written(redis_url):
    assert _run(redis_url, 3000, 0.0, "exit") == 3000


def test_a_sigkill_loses_at_most_the_records_in_flight(redis_url):
    n = 40
    assert _run(redis_url, n, 0.01, "kill") >= n - 1
