"""The static-batch teacher (train/teacher/batch.py), what the warm start generates with on a
CUDA device, run here on the CPU: its answers equal Hugging Face `generate`'s, the features it
captures equal a separate forward over the same tokens, and the store keeps them in memory
only when told to. Also the prompt set of every human turn (infra/prompts.py)."""

import numpy as np
import pytest
import torch

from infra.config import DataConfig, OSDConfig
from infra.prompts import Prompt, prompts_from_conversations
from infra.target import LoadedModel, build_tiny_llama, tiny_tokenizer
from train.distill.head import compute_features
from train.teacher.batch import StaticBatchTeacher
from train.teacher.data import generate_teacher_answers
from train.teacher.store import TeacherStore
from train.teacher.features import features_path

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]

NEW, K = 9, 6
LAYERS = (0, 2)
TEXTS = ["hi", "hello there", "a b c d e f g h", "x", "the quick brown fox jumps", "one two", "z z z z"]


@pytest.fixture(scope="module")
def loaded():
    return LoadedModel(build_tiny_llama(seed=5, num_layers=3), tiny_tokenizer(), "tiny-random", None, 0.0)


def _prompts():
    return [Prompt(f"p{i}", t, "other", "train") for i, t in enumerate(TEXTS)]


def _teacher(loaded, batch, tokens=None):
    tok = loaded.tokenizer
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    return StaticBatchTeacher(loaded.model, eos, pad, batch_size=batch, batch_tokens=tokens)


@pytest.mark.parametrize("batch,tokens", [(1, None), (3, None), (16, None), (16, 60)])
def test_answers_equal_hugging_face_generate(loaded, batch, tokens):
    hf = generate_teacher_answers(loaded.model, loaded.tokenizer, _prompts(), max_new_tokens=NEW, top_k=K,
                                  batch_size=4, progress=False).records
    got = generate_teacher_answers(loaded.model, loaded.tokenizer, _prompts(), max_new_tokens=NEW, top_k=K,
                                   progress=False, generate=_teacher(loaded, batch, tokens)).records
    for a, b in zip(hf, got):
        assert a.request_id == b.request_id and a.output_ids.tolist() == b.output_ids.tolist()
        assert np.array_equal(a.topk_ids, b.topk_ids)
        np.testing.assert_allclose(a.topk_logprobs.astype(np.float32), b.topk_logprobs.astype(np.float32),
                                   atol=2e-3)


def test_batches_respect_both_limits(loaded):
    t = _teacher(loaded, batch=3, tokens=40)
    groups = t.batches([10, 2, 7, 30, 5, 5, 1], max_new_tokens=4)
    assert sorted(i for g in groups for i in g) == list(range(7))
    lens = [10, 2, 7, 30, 5, 5, 1]
    for g in groups:  # longest first; a lone row may exceed the token cap, never two
        assert len(g) <= 3 and (len(g) == 1 or len(g) * (lens[g[0]] + 4) <= 40)
        assert [lens[i] for i in g] == sorted((lens[i] for i in g), reverse=True)


@pytest.mark.parametrize("batch", [2, 16])
def test_captured_features_equal_a_separate_forward(loaded, batch):
    got = generate_teacher_answers(loaded.model, loaded.tokenizer, _prompts(), max_new_tokens=NEW, top_k=K,
                                   progress=False, generate=_teacher(loaded, batch), feature_layers=LAYERS)
    assert got.layers == LAYERS and len(got.features) == len(TEXTS)
    seqs = [r.prompt_ids.tolist() + r.output_ids.tolist()[:-1] for r in got.records]
    ref = compute_features(loaded.model, seqs, LAYERS)
    for rec, rows, ids, feats, final, am in zip(got.records, got.features, ref.ids, ref.feats, ref.final, ref.argmax):
        assert rows.matches(rec) and rows.ids.tolist() == ids.tolist()
        assert rows.feats.dtype == rows.final.dtype == torch.bfloat16
        torch.testing.assert_close(rows.feats.float(), feats.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(rows.final.float(), final.float(), atol=2e-2, rtol=2e-2)
        assert rows.argmax.tolist() == am.tolist()
        assert rows.argmax[len(rec.prompt_ids) - 1:].tolist() == rec.output_ids.tolist()  # the greedy answer


def test_an_answer_cut_at_its_eos_keeps_the_rows_of_its_tokens(loaded):
    teacher = _teacher(loaded, 16)
    first = generate_teacher_answers(loaded.model, loaded.tokenizer, _prompts(), max_new_tokens=NEW, top_k=K,
                                     progress=False, generate=teacher, feature_layers=LAYERS)
    stop = first.records[2].output_ids.tolist()[3]  # a token one answer emits mid-way, declared the stop token
    tok = loaded.tokenizer
    teacher = StaticBatchTeacher(loaded.model, [stop], tok.pad_token_id if tok.pad_token_id is not None else stop,
                                 batch_size=16)
    got = generate_teacher_answers(loaded.model, loaded.tokenizer, _prompts(), max_new_tokens=NEW, top_k=K,
                                   progress=False, generate=teacher, feature_layers=LAYERS, eos_token_id=stop)
    assert any(len(r.output_ids) < NEW for r in got.records)
    for rec, rows in zip(got.records, got.features):
        assert rows.matches(rec) and rows.ids.shape[0] == len(rec.prompt_ids) + len(rec.output_ids) - 1


def test_a_store_told_to_keep_features_in_memory_writes_none(loaded, tmp_path):
    teacher = _teacher(loaded, 16)
    store = TeacherStore(tmp_path, {"k": 1}, shard_prompts=4, features_on_disk=False)

    def build(chunk, on_answer):
        return generate_teacher_answers(loaded.model, loaded.tokenizer, chunk, max_new_tokens=NEW, top_k=K,
                                        progress=on_answer, generate=teacher, feature_layers=LAYERS)

    filled = store.fill(_prompts(), build, tokens_per_prompt=NEW, progress=False, feature_layers=LAYERS)
    assert len(filled.records) == len(TEXTS) and all(f is not None for f in filled.features)
    assert store.shards() and not any(features_path(p).exists() for p in store.shards())
    again = TeacherStore(tmp_path, {"k": 1}, shard_prompts=4).fill(
        _prompts(), build, tokens_per_prompt=NEW, progress=False, feature_layers=LAYERS)
    assert again.generated == 0 and again.features == [None] * len(TEXTS)  # answers kept, features remade later


def _conv(cid, *turns):
    return {"id": cid, "conversations": [x for t in turns for x in ({"from": "human", "value": t},
                                                                    {"from": "gpt", "value": "ok"})]}


def test_every_human_turn_as_a_prompt():
    recs = [_conv("a", "first question", "second one", "continue"), _conv("b", "another", "continue"),
            _conv("c", "x" * 50, "short")]
    cfg = DataConfig(max_prompt_chars=40)
    first = prompts_from_conversations(recs, cfg, turns="first")
    assert [p.id for p in first] == ["a", "b"]  # c's first turn is too long: c has no first-turn prompt
    every = prompts_from_conversations(recs, cfg, turns="all")
    # turn ids name their conversation; "continue" once; a long first turn still lets its later ones in
    assert [(p.id, p.text) for p in every] == [("a", "first question"), ("a#t1", "second one"), ("a#t2", "continue"),
                                             ("b", "another"), ("c#t1", "short")]
    assert {p.split for p in every if p.id.startswith("a")} == {first[0].split}


def test_draft_init_flags_put_target_and_training_on_the_device(tmp_path):
    import argparse

    from pipeline.cli.draft import draft_init_config

    args = argparse.Namespace(prompts=None, max_new_tokens=None, teacher=None, budget_minutes=None, turns="first",
                              prompt_chars=4000, device="cuda", family="head", epochs=None, conversations=None,
                              config=None)
    cfg = draft_init_config(OSDConfig(), args)
    assert cfg.model.device == "cuda" and cfg.train.device == "cuda"
    assert cfg.train.head_warm_turns == "first" and cfg.train.warm_prompt_chars == 4000
    from pipeline.teacher.engine import teacher_for

    assert teacher_for(cfg) is None  # the warm start's own static batches, not the one-request GPU engine


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_answers_and_features_equal_hugging_face_and_a_separate_forward():
    model = build_tiny_llama(seed=5, num_layers=3).to("cuda")
    gpu = LoadedModel(model, tiny_tokenizer(), "tiny-random", None, 0.0)
    hf = generate_teacher_answers(model, gpu.tokenizer, _prompts(), max_new_tokens=NEW, top_k=K, batch_size=4,
                                  progress=False).records
    got = generate_teacher_answers(model, gpu.tokenizer, _prompts(), max_new_tokens=NEW, top_k=K, progress=False,
                                   generate=_teacher(gpu, 16), feature_layers=LAYERS)
    assert [r.output_ids.tolist() for r in hf] == [r.output_ids.tolist() for r in got.records]
    ref = compute_features(model, [r.prompt_ids.tolist() + r.output_ids.tolist()[:-1] for r in got.records], LAYERS)
    for rows, feats, am in zip(got.features, ref.feats, ref.argmax):
        assert rows.feats.device.type == "cuda" and rows.argmax.tolist() == am.tolist()
        torch.testing.assert_close(rows.feats.float(), feats.float(), atol=2e-2, rtol=2e-2)


def test_the_warm_start_with_the_batch_teacher_and_curve_points(tmp_path, monkeypatch):
    import json

    from tests.test_feature_capture import train_without_second_pass
    from train.warm.head import run_head_warm_start
    from train.teacher.features import TeacherDataError

    from train.teacher import sets

    train_without_second_pass(monkeypatch, "compute_features ran: the batch teacher captured every answer's features")
    monkeypatch.setattr(sets, "CUDA_BATCH_SIZE", 5)
    cfg = OSDConfig.model_validate({"state_dir": str(tmp_path), "model": {"target": "tiny-random"},
                                    "data": {"max_prompt_chars": 200},
                                    "train": {"head_warm_prompts": 16, "head_warm_max_new_tokens": 6, "warm_teacher": "batch",
                                              "held_out_every": 4, "head_warm_turns": "all"}})
    out = run_head_warm_start(cfg, out_dir=tmp_path / "head", progress=False, conversations=0, epochs=1,
                              curve=(0.25, 0.5))
    assert out["teacher_records"] > 0 and out["held_out_records"] > 0
    points = {f: json.loads((tmp_path / f"head-at-{f}" / "draft.json").read_text()) for f in ("0.25", "0.5")}
    rows = [points["0.25"]["metrics"]["train_tokens"], points["0.5"]["metrics"]["train_tokens"], out["train_tokens"]]
    assert rows == sorted(rows) and rows[0] < rows[2]  # a prefix of the answers each, the whole run last
    assert points["0.5"]["lineage"]["teacher_records"] == -(-out["teacher_records"] // 2)
    assert points["0.5"]["metrics"]["held_out_records"] == out["held_out_records"]  # one held-out set for all
    with pytest.raises(ValueError, match="fractions must lie in"):
        run_head_warm_start(cfg, out_dir=tmp_path / "x", progress=False, curve=(1.0,))
    few = cfg.model_copy(update={"train": cfg.train.model_copy(update={"head_warm_prompts": 1, "held_out_every": 1000})})
    with pytest.raises(TeacherDataError, match="held-out teacher records"):
        run_head_warm_start(few, out_dir=tmp_path / "y", progress=False, conversations=0, epochs=1)
