"""`osd draft init` end to end on the tiny target, each run in its own process (DeepSpeed
joins a process group, which must not leak into the test process)."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.pure


def draft_init(state, *args):
    env = {**os.environ, "OSD_MODEL__TARGET": "tiny-random", "OSD_STATE_DIR": str(state),
           "OSD_TRAIN__DRAFT_LAYERS": "1", "OSD_TRAIN__LR": "0.001", "OSD_TRAIN__TOKEN_BUDGET": "200",
           "OSD_DATA__MAX_PROMPT_CHARS": "200"}
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "draft", "init", "--prompts", "40",
                        "--max-new-tokens", "12", *args], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr


def test_warm_start_publishes_v1_and_resumes(tmp_path):
    import torch

    from infra.target import load_target
    from serve.engine import EngineOptions, GenerationParams, SpecEngine
    from infra.draft_model import load_draft

    first = draft_init(tmp_path, "--epochs", "1", "--out", str(tmp_path / "e1"))
    assert "published v1" in first and "resuming" not in first
    # Same settings, more epochs: the teacher cache is hit and epoch 1 is not redone.
    second = draft_init(tmp_path, "--epochs", "3")
    assert "(0.0 s; cached" in second
    assert "resuming after epoch 1" in second
    assert "epoch 1/3" not in second and "epoch 3/3" in second

    target = load_target("tiny-random", progress=False).model
    draft, info = load_draft(tmp_path / "drafts" / "v1", target)
    metrics = info["metrics"]
    assert metrics["alpha_est"] > metrics["alpha_est_before"]  # distillation helped on held-out records
    assert info["lineage"]["kind"] == "warm_start" and info["lineage"]["epochs"] == 3
    # The published draft serves, losslessly.
    eng = SpecEngine(target, draft, options=EngineOptions(k=3, max_seq_len=128))
    ref = SpecEngine(target, None, options=EngineOptions(max_seq_len=128))
    p = GenerationParams(max_new_tokens=16)
    assert eng.generate([5, 6, 7], p).output_ids == ref.generate([5, 6, 7], p).output_ids
    assert torch.is_tensor(next(draft.parameters()))
