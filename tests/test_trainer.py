"""DeepSpeed trainer actors on a real local Ray, reading a real redis-server's stream.

Tiny models, CPU, gloo. One Ray instance and one fixed record set for the module.
"""

import threading
import time

import pytest
import torch

from loop_helpers import greedy_records

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.deepspeed]

N_RECORDS = 60


@pytest.fixture(scope="module")
def records():
    """A fixed record set: the tiny target's own greedy outputs with their top-8."""
    return greedy_records(N_RECORDS, prompt_len=10, max_new_tokens=20)


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def stream(redis_url, tmp_path):
    """A fresh stream config pointing at the session's redis-server."""
    from infra.config import load_config

    def make(**train):
        return load_config(environ={}, overrides={
            "state_dir": str(tmp_path),
            "model": {"target": "tiny-random"},
            "stream": {"redis_url": redis_url, "stream": "t:records", "claim_idle_ms": 500},
            "train": {"num_workers": 2, "draft_layers": 1, "lr": 1e-3, "token_budget": 100,
                      "export_every_records": 20, "held_out_every": 6, "collective_timeout_s": 90, **train},
        })
    return make


def produce(cfg, recs):
    from infra.records.streams import RecordProducer

    with RecordProducer(cfg.stream.redis_url, cfg.stream) as p:
        for r in recs:
            assert p.submit(r)
        assert p.flush(30)
        assert p.stats().written == len(recs)


def group_state(cfg):
    from infra.records.streams import RecordConsumer

    with RecordConsumer(cfg.stream.redis_url, cfg.stream, name="inspector") as c:
        return c.pending(), c.lag()


def mean_fkl(draft, recs, max_seq_len=1024):
    from train.distill.batching import pack, position_logits
    from train.distill.losses import distill_loss

    with torch.no_grad():
        b = pack(recs, max_seq_len)
        return float(distill_loss(position_logits(draft, b), b.topk_ids, b.topk_logprobs, kind="fkl"))


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_two_workers_learn_and_export_loadable_drafts(ray_local, stream, records, tmp_path, stage):
    from infra.target import load_target
    from serve.engine.core import GenerationParams, SpecEngine
    from engine_options import small_options
    from infra.drafts.layer import build_draft, load_draft
    from infra.drafts.spec import draft_spec_from_train
    from train.online.trainer import TrainerGroup

    cfg = stream(zero_stage=stage)
    produce(cfg, records)
    group = TrainerGroup(cfg, tmp_path / "run")
    try:
        stats = group.run(idle_stop_s=3, timeout=300)
    finally:
        group.shutdown()
    assert sum(s.records_trained for s in stats) + sum(s.records_acked for s in stats) > 0
    assert group_state(cfg) == (0, 0)  # every record delivered and acked
    exports = stats[0].exports
    assert exports and all(e["zero_stage"] == stage and e["world_size"] == 2 for e in exports)
    assert exports[-1]["parent"] == (exports[-2]["version"] if len(exports) > 1 else None)
    from infra.registry import Registry

    published = Registry.from_config(cfg).get(exports[-1]["version"])  # candidates land in the registry
    assert published.lineage["parent"] == exports[-1]["parent"]
    # Rank 0 estimates alpha on the held-out records it read itself. Which rank reads which
    # records is a race (one XREADGROUP may take all 60), so rank 0 may hold none: then None.
    m = published.metrics
    assert (m["alpha_est"] is not None) == (m["held_out_records"] > 0), m

    target = load_target("tiny-random", progress=False).model
    before = build_draft(target, draft_spec_from_train(cfg.train))  # what the group started from
    after, info = load_draft(exports[-1]["path"], target)
    # Distillation moved the draft towards the target on the records it was trained on.
    assert mean_fkl(after, records) < mean_fkl(before, records)

    # The exported weights equal the final checkpoint's consolidated weights, and serve.
    from safetensors.torch import load_file

    ckpt = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[-1]
    weights = load_file(str(ckpt / "consolidated.safetensors"))
    params = dict(after.named_parameters())
    for name, w in weights.items():
        assert torch.equal(params[name].detach(), w), name
    eng = SpecEngine(target, after, options=small_options(k=3, max_seq_len=128))
    r = eng.generate([1, 2, 3, 4], GenerationParams(max_new_tokens=12))
    ref = SpecEngine(target, None, options=small_options(max_seq_len=128)).generate(
        [1, 2, 3, 4], GenerationParams(max_new_tokens=12))
    assert r.output_ids == ref.output_ids  # lossless with the trained draft
    assert r.stats.num_draft_tokens > 0

    if stage == 2:
        # A different world size resumes from the consolidated weights, loudly, not from scratch.
        one = TrainerGroup(cfg, tmp_path / "run", num_workers=1)
        try:
            assert one.resumed[0]["resumed"] == "consolidated"
            assert one.resumed[0]["world_size"] == 2
        finally:
            one.shutdown()


def test_killed_worker_resumes_and_loses_no_record(ray_local, stream, records, tmp_path):
    import ray

    from train.distill.ds_engine import DistillEngine
    from train.online.trainer import run_with_restarts

    cfg = stream(zero_stage=2, export_every_records=10)
    produce(cfg, records)
    ckpts = tmp_path / "run" / "checkpoints"
    killed = {}

    def killer():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not DistillEngine.complete_tags(ckpts):
            time.sleep(0.2)
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if actor["name"].endswith("rank1"):
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
                killed["at"] = DistillEngine.complete_tags(ckpts)[-1]
                return

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    stats = run_with_restarts(cfg, tmp_path / "run", restarts=2, idle_stop_s=4, timeout=300)
    t.join(timeout=5)
    assert killed, "the worker was never killed"
    assert stats[0].resumed is not None and stats[0].resumed["resumed"] == "full"
    assert group_state(cfg) == (0, 0)  # the killed worker's pending records were reclaimed and acked
    tags = DistillEngine.complete_tags(ckpts)
    assert tags[-1] > killed["at"]


def test_corrupt_records_go_to_dead_letter_and_training_goes_on(ray_local, stream, records, tmp_path):
    import redis

    from infra.records.streams import FIELD, dead_letter_stream
    from train.online.trainer import TrainerGroup

    cfg = stream(num_workers=1, zero_stage=1)
    client = redis.Redis.from_url(cfg.stream.redis_url)
    client.xadd(cfg.stream.stream, {FIELD: b"not an arrow payload"})
    produce(cfg, records[:20])
    group = TrainerGroup(cfg, tmp_path / "run")
    try:
        stats = group.run(idle_stop_s=3, timeout=300)
    finally:
        group.shutdown()
    assert stats[0].dead_lettered == 1
    assert client.xlen(dead_letter_stream(cfg.stream.stream)) == 1
    assert stats[0].exports and group_state(cfg) == (0, 0)


def test_replay_steps_train_again_on_recent_records_and_ack_each_once(ray_local, stream, records, tmp_path):
    from train.online.trainer import TrainerGroup

    cfg = stream(num_workers=1, zero_stage=2, replay_steps=2)
    produce(cfg, records[:24])
    group = TrainerGroup(cfg, tmp_path / "run")
    try:
        stats = group.run(idle_stop_s=3, timeout=300)[0]
    finally:
        group.shutdown()
    fresh = stats.steps - stats.replay_steps
    assert fresh > 0 and stats.replay_steps == 2 * fresh  # two replayed steps after every new one
    assert stats.records_trained == 24 - sum(1 for r in records[:24] if _held_out(r, cfg))  # new ones counted once
    assert group_state(cfg) == (0, 0) and stats.exports


def _held_out(record, cfg):
    from train.online.trainer import is_held_out

    return is_held_out(record.record_id, cfg.train.held_out_every)


_DURABLE_SAVE = """
import json, os, sys
from pathlib import Path
synced = []
real_fsync = os.fsync
def recording_fsync(fd):
    synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
    return real_fsync(fd)
os.fsync = recording_fsync
from infra.config import load_config
from infra.redis.server import free_port
from infra.target import load_target
from infra.drafts.layer import DraftSpec, build_draft
from train.distill.ds_engine import DistillEngine, init_distributed
init_distributed(0, 1, "127.0.0.1", free_port(), "cpu", 120)
cfg = load_config(environ={}, overrides={"train": {"zero_stage": 1}}).train
target = load_target("tiny-random", progress=False).model
engine = DistillEngine(build_draft(target, DraftSpec(num_layers=1)), cfg)
tag, _ = engine.save(Path(sys.argv[1]), {"records_total": 0})
print(json.dumps({"tag": tag, "synced": synced}))
"""


def test_checkpoint_is_fsynced_before_save_returns_and_the_records_are_acked(tmp_path):
    """The trainer acks as soon as DistillEngine.save returns: by then every file of the
    checkpoint, COMPLETE included, and the directories naming them must have been fsynced."""
    import json
    import os
    import re
    import subprocess
    import sys

    ckpt = (tmp_path / "ckpt").resolve()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _DURABLE_SAVE, str(ckpt)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    tag_dir = ckpt / out["tag"]
    files = {str(p) for p in tag_dir.rglob("*") if p.is_file()}
    assert str(tag_dir / "COMPLETE") in files and str(tag_dir / "consolidated.safetensors") in files
    # COMPLETE is written as a temp file, fsynced, then renamed, so its fsync shows the temp name
    order = [re.sub(r"/\.([^/]+)\.tmp-[0-9a-f]+$", r"/\1", p) for p in out["synced"]]
    synced = set(order)
    assert files <= synced, sorted(files - synced)
    assert {str(tag_dir), str(ckpt)} <= synced  # the names of the files and of the tag directory
    complete = str(tag_dir / "COMPLETE")
    assert order.index(complete) < len(order) - 1 - order[::-1].index(str(tag_dir))  # the rename made durable
    assert json.loads((tag_dir / "COMPLETE").read_text())["records_total"] == 0
    assert not [p for p in tag_dir.iterdir() if ".tmp" in p.name]  # COMPLETE went in by rename


def test_a_group_whose_start_fails_gives_its_placement_group_back(ray_local, stream, tmp_path):
    """Redis away while the workers set up: the group raises, and its CPUs are free for the restart."""
    import ray
    from ray.util import placement_group_table

    from infra.redis.server import free_port
    from train.online.trainer import TrainerGroup

    cfg = stream(num_workers=1, zero_stage=1)
    cfg = cfg.model_copy(update={"stream": cfg.stream.model_copy(update={"redis_url": f"redis://127.0.0.1:{free_port()}"})})
    with pytest.raises((ray.exceptions.RayTaskError, ray.exceptions.RayActorError)):
        TrainerGroup(cfg, tmp_path / "run")
    states = [pg["state"] for pg in placement_group_table().values()]
    assert states and all(s == "REMOVED" for s in states), states
    assert not [a for a in ray.util.list_named_actors() if a.startswith("osd-trainer-")]


_AUTOCAST_STEP = """
import json, torch
from infra.config import load_config
from infra.redis.server import free_port
from train.distill.ds_engine import DistillEngine, init_distributed
init_distributed(0, 1, "127.0.0.1", free_port(), "cpu", 120)
cfg = load_config(environ={}, overrides={"train": {"zero_stage": 1}}).train
seen = []
def loss_fn(model, x):
    y = model(x)
    seen.append(str(y.dtype))
    return y.float().pow(2).mean()
out = {}
for name, autocast in (("bfloat16", torch.bfloat16), ("none", None)):
    torch.manual_seed(0)
    engine = DistillEngine(torch.nn.Linear(8, 4), cfg, autocast=autocast)
    before = [p.detach().clone() for p in engine.module.parameters()]
    for _ in range(3):  # the learning rate warms up from 0
        engine.train_batch(torch.randn(16, 8), loss_fn)
    out[name] = {"forward": seen[-1], "weights": sorted({str(p.dtype) for p in engine.module.parameters()}),
                 "moved": any(not torch.equal(b, p) for b, p in zip(before, engine.module.parameters()))}
print(json.dumps(out))
"""


def test_an_autocast_step_runs_its_forward_in_bfloat16_and_keeps_float32_weights():
    """The head's warm start (train/distill/ds_engine.py autocast_dtype) steps DeepSpeed with the forward under
    autocast: the loss's GEMMs in bfloat16, the weights it updates still float32."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _AUTOCAST_STEP], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bfloat16"] == {"forward": "torch.bfloat16", "weights": ["torch.float32"], "moved": True}
    assert out["none"] == {"forward": "torch.float32", "weights": ["torch.float32"], "moved": True}


def test_auto_autocast_is_bfloat16_only_where_bfloat16_is_native(monkeypatch):
    import infra.common.cpu
    from train.distill.ds_engine import autocast_dtype

    monkeypatch.setattr(infra.common.cpu, "native_bf16_gemm", lambda: False)  # an AVX2-only CPU
    assert autocast_dtype("auto", "cpu") is None and autocast_dtype("auto", "cuda") == torch.bfloat16
    assert autocast_dtype("bfloat16", "cpu") == torch.bfloat16 and autocast_dtype("none", "cuda") is None
    monkeypatch.setattr(infra.common.cpu, "native_bf16_gemm", lambda: True)  # AVX-512 or AMX
    assert autocast_dtype("auto", "cpu") == torch.bfloat16
