"""`osd draft init` end to end on the tiny target, each run in its own process (DeepSpeed
joins a process group, which must not leak into the test process)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.deepspeed


def draft_init(state, *args, family: tuple[str, ...] = ("--family", "layer")) -> dict:
    """Runs `osd draft init --family layer` (family=(): the default family); returns the JSON
    summary it prints last."""
    env = {**os.environ, "OSD_MODEL__TARGET": "tiny-random", "OSD_STATE_DIR": str(state),
           "OSD_TRAIN__DRAFT_LAYERS": "1", "OSD_TRAIN__LR": "0.001", "OSD_TRAIN__TOKEN_BUDGET": "200",
           "OSD_TRAIN__WARM_MAX_NEW_TOKENS": "12",
           "OSD_TRAIN__HEAD_WARM_MAX_NEW_TOKENS": "12", "OSD_DATA__MAX_PROMPT_CHARS": "200"}
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "draft", "init", *family, "--prompts", "40",
                        *args], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if line == "{")
    return json.loads("\n".join(lines[start:]))


def teacher_files(state) -> dict:
    """Teacher cache shards -> (inode, mtime): a rebuild writes a new file and renames it."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (state / "teacher").glob("*/shard-*.arrow")}


def checkpoints(state) -> dict:
    """epoch -> the COMPLETE marker's text of its warm-start checkpoint (it holds a write time)."""
    out = {}
    for marker in (state / "warm-start").glob("*/checkpoints/step-*/COMPLETE"):
        text = marker.read_text()
        out[json.loads(text)["epoch"]] = text
    return out


def test_warm_start_publishes_v1_and_resumes(tmp_path):
    import torch

    from infra.drafts.layer import load_draft
    from infra.target import load_target
    from serve.engine.core import GenerationParams, SpecEngine
    from engine_options import small_options

    first = draft_init(tmp_path, "--epochs", "1", "--out", str(tmp_path / "e1"))
    assert first["version"] == "v1" and first["path"] == str(tmp_path / "e1")
    assert (tmp_path / "e1" / "draft.json").is_file()
    after_first = checkpoints(tmp_path)
    assert list(after_first) == [0]
    teacher = teacher_files(tmp_path)
    assert len(teacher) == 1  # 40 prompts: one shard of train/teacher/sets.py SHARD_PROMPTS (256)

    # Same settings, more epochs: the teacher cache is hit and epoch 1 is not redone.
    second = draft_init(tmp_path, "--epochs", "3")
    assert second["path"] == str(tmp_path / "drafts" / "v1")
    assert teacher_files(tmp_path) == teacher  # read, not rebuilt
    after_second = checkpoints(tmp_path)
    assert sorted(after_second) == [0, 1, 2]
    assert after_second[0] == after_first[0]  # epoch 1's checkpoint was resumed from, not rewritten

    target = load_target("tiny-random", progress=False).model
    draft, info = load_draft(tmp_path / "drafts" / "v1", target)
    metrics = info["metrics"]
    assert metrics["alpha_est"] > metrics["alpha_est_before"]  # distillation helped on held-out records
    assert info["lineage"]["kind"] == "warm_start" and info["lineage"]["epochs"] == 3
    # The published draft serves, losslessly.
    eng = SpecEngine(target, draft, options=small_options(k=3, max_seq_len=128))
    ref = SpecEngine(target, None, options=small_options(max_seq_len=128))
    p = GenerationParams(max_new_tokens=16)
    assert eng.generate([5, 6, 7], p).output_ids == ref.generate([5, 6, 7], p).output_ids
    assert torch.is_tensor(next(draft.parameters()))


def test_the_default_warm_start_is_the_head_that_osd_up_and_osd_serve_then_take(tmp_path):
    """Issue 12, item 5, end to end on the tiny target: `osd draft init` with no --family
    publishes the head at <state_dir>/drafts/head-v1; `osd up` publishes it as v1 and
    `osd serve`'s auto picks it."""
    from infra.config import load_config
    from infra.registry import Registry
    from pipeline.stack.up import ensure_stable
    from serve.spec_decode.specs import resolve_auto

    out = draft_init(tmp_path, "--epochs", "1", "--conversations", "8", family=())
    head = tmp_path / "drafts" / "head-v1"
    assert out["path"] == str(head) and out["alpha_est"] > 0
    info = json.loads((head / "draft.json").read_text())
    assert info["lineage"]["conversations"] == 8 and info["lineage"]["epochs"] == 1  # the flags reached it
    assert json.loads((head / "draft.json").read_text())["spec"]["family"] == "head"
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path), "model": {"target": "tiny-random"}})
    named = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"draft": "head+suffix"})})
    assert resolve_auto(named)[0] == f"{head}+suffix"  # `osd serve --draft head+suffix` serves it
    assert ensure_stable(cfg) == "v1"
    v1 = Registry.from_config(cfg).local_path("v1")
    assert json.loads((v1 / "draft.json").read_text())["spec"]["family"] == "head"


def test_too_few_prompts_for_a_held_out_record_is_said_plainly(tmp_path):
    """Issue 44, bug 10: no held-out record made the acceptance estimate None, and formatting
    it ended `osd draft init` in a TypeError."""
    env = {**os.environ, "OSD_MODEL__TARGET": "tiny-random", "OSD_STATE_DIR": str(tmp_path),
           "OSD_TRAIN__DRAFT_LAYERS": "1", "OSD_TRAIN__TOKEN_BUDGET": "200", "OSD_TRAIN__WARM_MAX_NEW_TOKENS": "8",
           "OSD_TRAIN__HELD_OUT_EVERY": "1000000", "OSD_DATA__MAX_PROMPT_CHARS": "200"}
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "draft", "init", "--family", "layer",
                        "--prompts", "8", "--epochs", "1"], env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert "Traceback" not in out, out[-3000:]
    assert p.returncode == 0, out[-3000:]
    assert "no held-out record" in out
