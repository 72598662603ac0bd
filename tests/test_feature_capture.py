"""Target features captured during the engine's teacher generation (pipeline/teacher/feature_recorder.py,
pipeline/teacher/engine.py EngineTeacher.capture): equal to a separate forward over the same
tokens through the same runner, kept in the teacher cache, and what the head's warm start trains
on with no second forward pass (train/warm/head.py)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from infra.config import OSDConfig
from infra.prompts import Prompt
from infra.target import LoadedModel, build_tiny_llama, tiny_tokenizer
from pipeline.teacher.engine import EngineTeacher
from train.teacher.data import generate_teacher_answers

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]

NEW, K = 10, 8
LAYERS = (0, 1)  # of a 3-layer target: the last layer is not among them, the recorder adds it
ROWS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [40, 41], [7], [9] * 30,
        [100, 3, 100, 3, 100], [250, 251, 252, 253, 254, 1, 2]]


@pytest.fixture(scope="module")
def loaded():
    return LoadedModel(build_tiny_llama(seed=3, num_layers=3), tiny_tokenizer(), "tiny-random", None, 0.0)


def _cfg(batch: int, **over) -> OSDConfig:
    # prefill_chunk 4: prompts take several chunks, beside the other requests' decode steps
    return OSDConfig.model_validate({"model": {"target": "tiny-random"}, "serve": {"prefill_chunk": 4},
                                     "train": {"warm_batch_size": batch}, **over})


def _separate(runner, tokens, layers):
    """(features of `layers`, final hidden, argmax) of one fresh-cache forward over `tokens`."""
    last = len(runner.blocks) - 1
    want = tuple(sorted(set(layers) | {last}))
    logits, f = runner.forward_features(torch.tensor(tokens), runner.new_cache(), want)
    h = f.shape[-1] // len(want)
    feats = torch.cat([f[:, want.index(i) * h:(want.index(i) + 1) * h] for i in layers], -1)
    final = F.rms_norm(f[:, want.index(last) * h:], (h,), runner.norm, runner.eps)
    return feats, final, logits.argmax(-1)


@pytest.mark.parametrize("batch", [2, 6])  # fewer slots than prompts, and all at once
def test_captured_features_equal_a_separate_forward_through_the_same_runner(loaded, batch):
    teacher = EngineTeacher(_cfg(batch), loaded)
    got = teacher.capture(ROWS, NEW, K, None, LAYERS)
    plain = teacher(ROWS, NEW, K, None)
    runner = teacher.engine(K, 64).target
    for prompt, ((out, top_ids, _), rows), (out0, top_ids0, _) in zip(ROWS, got, plain):
        assert out.tolist() == out0.tolist() and np.array_equal(top_ids, top_ids0)  # capture changes no answer
        tokens = prompt + out.tolist()
        assert rows.ids.tolist() == tokens[:-1]  # the last token is never fed to the target: no row
        assert rows.feats.dtype == rows.final.dtype == torch.bfloat16
        feats, final, argmax = _separate(runner, tokens[:-1], LAYERS)
        torch.testing.assert_close(rows.feats.float(), feats.to(torch.bfloat16).float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(rows.final.float(), final.to(torch.bfloat16).float(), atol=2e-2, rtol=2e-2)
        assert rows.argmax.tolist() == argmax.tolist()
        assert rows.argmax[len(prompt) - 1:].tolist() == out.tolist()  # generated rows: the greedy tokens


def test_an_answer_cut_at_its_eos_keeps_the_rows_of_its_tokens(loaded):
    prompts = [Prompt(f"p{i}", t, "other", "train") for i, t in enumerate(["hi", "hello there", "a b c d e f"])]
    teacher = EngineTeacher(_cfg(3), loaded)
    first = generate_teacher_answers(loaded.model, loaded.tokenizer, prompts, max_new_tokens=NEW, top_k=K,
                                     progress=False, generate=teacher, feature_layers=LAYERS)
    stop = first.records[1].output_ids.tolist()[3]  # a token answer 1 emits mid-way, declared the stop token
    got = generate_teacher_answers(loaded.model, loaded.tokenizer, prompts, max_new_tokens=NEW, top_k=K,
                                   progress=False, generate=teacher, feature_layers=LAYERS, eos_token_id=stop)
    assert got.layers == LAYERS and any(len(r.output_ids) < NEW for r in got.records)
    for rec, rows in zip(got.records, got.features):
        assert rows.matches(rec) and rows.ids.shape[0] == len(rec.prompt_ids) + len(rec.output_ids) - 1
    none = generate_teacher_answers(loaded.model, loaded.tokenizer, prompts, max_new_tokens=NEW, top_k=K,
                                    progress=False, feature_layers=LAYERS)  # Hugging Face captures none
    assert none.features is None


def test_the_recorder_refuses_what_it_cannot_label(loaded):
    from pipeline.teacher.feature_recorder import FeatureRecorder
    from serve.engine.sequence import GenerationParams
    from serve.sampling.verify import SamplingParams

    with pytest.raises(ValueError, match="layers"):
        FeatureRecorder(loaded.model, (5,))
    teacher = EngineTeacher(_cfg(2), loaded)
    eng = teacher.engine(K, 64)
    recorder = FeatureRecorder(loaded.model, LAYERS)
    sampled = GenerationParams(max_new_tokens=4, sampling=SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="greedy"):
        eng.generate_many([ROWS[0]], sampled, draft=recorder)
    with pytest.raises(KeyError, match="no features"):
        recorder.take([1, 2, 3])


class _Engine:
    """DistillEngine's contract (train_batch, export_weights) over AdamW: no process group."""

    def __init__(self, model, tc, autocast=None):
        self.model = model
        self.autocast = autocast
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)

    def train_batch(self, batch, loss_fn):
        with torch.autocast("cpu", dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            loss = loss_fn(self.model, batch)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def export_weights(self):
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


def train_without_second_pass(monkeypatch, why: str) -> None:
    """The head's warm start trains in-process (no DeepSpeed process group), and any forward pass
    for features (train.distill.head.compute_features) fails the test with `why`."""
    import train.distill.ds_engine
    import train.distill.head

    def no_forward(*a, **k):
        raise AssertionError(why)

    monkeypatch.setattr(train.distill.head, "compute_features", no_forward)
    monkeypatch.setattr(train.distill.ds_engine, "init_distributed", lambda *a, **k: None)
    monkeypatch.setattr(train.distill.ds_engine, "DistillEngine", _Engine)


def test_the_head_warm_start_trains_on_captured_features_with_no_second_pass(tmp_path, monkeypatch):
    import json

    from train.warm.head import run_head_warm_start

    train_without_second_pass(monkeypatch, "compute_features ran for teacher records whose features were captured")
    cfg = OSDConfig.model_validate({"state_dir": str(tmp_path), "model": {"target": "tiny-random"},
                                    "data": {"max_prompt_chars": 200},
                                    "train": {"head_warm_prompts": 12, "head_warm_max_new_tokens": 8, "warm_batch_size": 4,
                                              "held_out_every": 4}})
    teacher = EngineTeacher(cfg)
    out = run_head_warm_start(cfg, out_dir=tmp_path / "head", progress=False, conversations=0, epochs=1,
                              generate=teacher)
    info = json.loads((tmp_path / "head" / "draft.json").read_text())
    assert info["spec"]["family"] == "head" and out["teacher_records"] > 0 and out["held_out_records"] > 0
    assert out["train_tokens"] > 0 and out["loss_last"] is not None
    assert list((tmp_path / "teacher").glob("*/shard-*.features.pt"))

    def no_generation(*a, **k):
        raise AssertionError("the teacher generated again: the cache with features should serve the rerun")

    monkeypatch.setattr(teacher, "capture", no_generation)
    again = run_head_warm_start(cfg, out_dir=tmp_path / "head", progress=False, conversations=0, epochs=1,
                                generate=teacher, force=True)
    assert again["train_tokens"] == out["train_tokens"]


def test_without_captured_features_the_warm_start_computes_them(tmp_path, monkeypatch):
    import train.distill.ds_engine
    import train.distill.head
    from train.warm.head import run_head_warm_start

    calls = []
    real = train.distill.head.compute_features

    def counted(target, seqs, *a, **k):
        calls.append(len(seqs))
        return real(target, seqs, *a, **k)

    monkeypatch.setattr(train.distill.head, "compute_features", counted)
    monkeypatch.setattr(train.distill.ds_engine, "init_distributed", lambda *a, **k: None)
    monkeypatch.setattr(train.distill.ds_engine, "DistillEngine", _Engine)
    cfg = OSDConfig.model_validate({"state_dir": str(tmp_path), "model": {"target": "tiny-random"},
                                    "data": {"max_prompt_chars": 200},
                                    "train": {"head_warm_prompts": 8, "head_warm_max_new_tokens": 6, "warm_teacher": "hf",
                                              "held_out_every": 4}})
    out = run_head_warm_start(cfg, out_dir=tmp_path / "head", progress=False, conversations=0, epochs=1)
    assert sum(calls) == 8 and out["train_tokens"] > 0  # Hugging Face's answers: one forward over all of them
