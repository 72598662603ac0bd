"""The trainer SIGKILLed at its boundaries, then started again on the same run directory and
stream: no record is lost, none covered by a COMPLETE checkpoint is trained twice, and no
half-published version is ever loadable."""

import json
import subprocess
import sys

import pytest

from loop_helpers import greedy_records
from tests.faults.conftest import ROOT, run_killed

pytestmark = [pytest.mark.redis, pytest.mark.deepspeed]

N_RECORDS = 30

# One trainer rank (world size 1, gloo) in its own process: DeepSpeed's process group must not
# leak into the test process. Prints its totals as JSON when it ends by itself.
_TRAIN = """
import json, sys
from infra.redis.server import free_port
from train.online.trainer import TrainerWorker
args = json.loads(sys.argv[1])
w = TrainerWorker(args["cfg"], 0, 1, args["run_dir"])
resumed = w.setup("127.0.0.1", free_port())
s = w.run(idle_stop_s=args["idle_stop_s"])
w.close()
print(json.dumps({"records_total": w.records_total, "trained": s.records_trained,
                  "resumed": (resumed or {}).get("records_total"), "skipped": (resumed or {}).get("skipped")}))
"""


@pytest.fixture(scope="module")
def records():
    return greedy_records(N_RECORDS, prompt_len=8, max_new_tokens=12)


def _cfg(tmp_path, redis_url):
    from infra.config import load_config

    return load_config(environ={}, overrides={
        "state_dir": str(tmp_path), "model": {"target": "tiny-random"},
        "stream": {"redis_url": redis_url, "stream": "t:records", "claim_idle_ms": 300},
        "train": {"num_workers": 1, "draft_layers": 1, "token_budget": 100, "export_every_records": 10,
                  "held_out_every": 1000, "gate": {"resamples": 100}}})


def _produce(cfg, recs):
    from infra.records.streams import RecordProducer

    with RecordProducer(cfg.stream.redis_url, cfg.stream) as p:
        for r in recs:
            p.submit(r)
        assert p.flush(30) and p.stats().written == len(recs)


def _train(cfg, run_dir, idle_stop_s=2.0) -> dict:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "DS_ACCELERATOR": "cpu", "HOME": str(run_dir),
           "OMP_NUM_THREADS": "1"}  # a tiny model: one thread is fastest, and the cores are shared
    p = subprocess.run([sys.executable, "-c", _TRAIN, json.dumps(
        {"cfg": cfg.model_dump(mode="json"), "run_dir": str(run_dir), "idle_stop_s": idle_stop_s})],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("point", ["trainer.mid_step", "trainer.after_complete", "trainer.before_publish",
                                   "registry.before_manifest"])
def test_kill_at_a_boundary_loses_nothing_and_trains_nothing_twice(tmp_path, redis_url, records, point):
    from infra.registry import Registry

    cfg = _cfg(tmp_path, redis_url)
    _produce(cfg, records)
    run_dir = tmp_path / "run"
    run_killed(_TRAIN, point, {"cfg": cfg.model_dump(mode="json"), "run_dir": str(run_dir), "idle_stop_s": 2.0},
               timeout=300)
    reg = Registry.from_config(cfg)
    assert reg.list() == []  # the kill came before the first version's manifest: nothing half-published shows
    out = _train(cfg, run_dir)
    assert (out["resumed"] is None) == (point == "trainer.mid_step")  # killed before any checkpoint
    # The checkpoint's records are not trained again; the others are trained once, after the restart.
    # Record ids are random, so one of them may fall among the held-out ones (1 in held_out_every).
    from train.gate.evaluator import is_held_out

    n_train = sum(not is_held_out(r.record_id, cfg.train.held_out_every) for r in records)
    assert out["records_total"] == n_train, f"trained {out['records_total']} times for {n_train} records"
    from infra.redis.loop_status import read_starts
    import redis

    assert read_starts(redis.Redis.from_url(redis_url), cfg.stream.stream) == {"trainer-0": 2}  # ops: 1 restart
    for v in reg.list():  # every version the registry lists is whole: its digests check
        reg.local_path(v.id)
    if point == "registry.before_manifest":  # the kill left a payload without a manifest: gc takes it
        assert any("payload-" in r for r in reg.gc(keep_last=5, orphan_age_s=0))
