"""pipeline/teacher/engine.py: the warm start's teacher answers through the serving engine's
continuous batching equal Hugging Face generate's, and land in their own cache entry."""

import numpy as np
import pytest

from infra.config import OSDConfig
from infra.prompts import Prompt
from infra.target import LoadedModel, build_tiny_llama, load_target, tiny_tokenizer
from pipeline.teacher.engine import EngineTeacher, teacher_for
from train.teacher.data import generate_teacher_records
from train.teacher.sets import cached_warm_records, engine_teacher_tag, teacher_records, warm_prompts

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]

TEXTS = ["hi", "hello world, how are you today?", "a", "what is 2+2? tell me", "write a poem about the sea",
         "ok then", "one more prompt, a little longer than most of the others here"]
PROMPTS = [Prompt(f"p{i}", t, "other", "train") for i, t in enumerate(TEXTS)]
NEW, K = 12, 8


@pytest.fixture(scope="module")
def loaded():
    return LoadedModel(build_tiny_llama(seed=0, num_layers=2), tiny_tokenizer(), "tiny-random", None, 0.0)


@pytest.fixture(scope="module")
def hf(loaded):
    return generate_teacher_records(loaded.model, loaded.tokenizer, PROMPTS, max_new_tokens=NEW, top_k=K,
                                    batch_size=4, progress=False)


def _cfg(batch: int, **train) -> OSDConfig:
    return OSDConfig.model_validate({"model": {"target": "tiny-random"},
                                     "train": {"warm_batch_size": batch, **train}})


def _records(loaded, batch: int, eos=None):
    teacher = EngineTeacher(_cfg(batch), loaded)
    return generate_teacher_records(loaded.model, loaded.tokenizer, PROMPTS, max_new_tokens=NEW, top_k=K,
                                    progress=False, eos_token_id=eos, generate=teacher)


@pytest.mark.parametrize("batch", [1, 3, 16])  # fewer slots than prompts: finished answers free slots for the rest
def test_engine_answers_equal_hf_generate(loaded, hf, batch):
    got = _records(loaded, batch)
    assert [r.request_id for r in got] == [p.id for p in PROMPTS]
    for a, b in zip(got, hf):
        assert a.prompt_ids.tolist() == b.prompt_ids.tolist()
        assert a.output_ids.tolist() == b.output_ids.tolist()
        assert np.array_equal(a.topk_ids, b.topk_ids)
        np.testing.assert_allclose(a.topk_logprobs.astype(np.float32), b.topk_logprobs.astype(np.float32),
                                   atol=1e-2, rtol=1e-3)
        assert a.draft_version == "teacher" and not a.accepted.any() and (a.draft_tokens == -1).all()


def test_engine_answers_end_at_the_first_eos_as_hf_does(loaded, hf):
    stop = hf[0].output_ids.tolist()[4]  # a token prompt 0 emits mid-way, declared the stop token
    want = generate_teacher_records(loaded.model, loaded.tokenizer, PROMPTS, max_new_tokens=NEW, top_k=K,
                                    batch_size=4, progress=False, eos_token_id=stop)
    got = _records(loaded, 3, eos=stop)
    assert [r.output_ids.tolist() for r in got] == [r.output_ids.tolist() for r in want]
    assert any(len(r.output_ids) < NEW for r in got)


def test_a_prompt_over_the_context_is_refused_before_any_generation(loaded):
    from train.teacher.data import TeacherDataError

    long = Prompt("long", "word " * 5000, "other", "train")
    with pytest.raises(TeacherDataError, match="long"):
        generate_teacher_records(loaded.model, loaded.tokenizer, [PROMPTS[0], long], max_new_tokens=NEW,
                                 top_k=K, progress=False, generate=EngineTeacher(_cfg(2), loaded))


def test_engine_records_have_their_own_cache_entry_and_the_trainer_finds_them(tmp_path):
    cfg = OSDConfig.model_validate({"state_dir": str(tmp_path), "model": {"target": "tiny-random"},
                                    "train": {"warm_prompts": 3, "warm_max_new_tokens": 4}})
    target = load_target("tiny-random", progress=False)
    prompts = warm_prompts(cfg, 3)
    teacher = teacher_for(cfg)
    assert isinstance(teacher, EngineTeacher) and teacher.tag == engine_teacher_tag(cfg)
    assert teacher_for(cfg.model_copy(update={"train": cfg.train.model_copy(update={"warm_teacher": "hf"})})) is None
    built = teacher_records(cfg, target, prompts, progress=False, generate=EngineTeacher(cfg, target))
    assert len(list((tmp_path / "teacher").glob("*/shard-*.arrow"))) == 1
    found = cached_warm_records(cfg, target)  # a warm replay reads what draft init left
    assert [r.output_ids.tolist() for r in found] == [r.output_ids.tolist() for r in built]
    teacher_records(cfg, target, prompts, progress=False)  # Hugging Face: another key, another store
    assert len(list((tmp_path / "teacher").glob("*/shard-*.arrow"))) == 2


class SlowTeacher:
    """A BatchGenerate whose every call takes 10 s of a fake clock (made-up answers)."""

    tag = "fake"

    def __init__(self, clock):
        self.clock, self.calls = clock, 0

    def __call__(self, rows, max_new_tokens, top_k, on_answer):
        self.calls += 1
        self.clock[0] += 10.0
        out = []
        for _ in rows:
            ids = np.arange(3 * top_k, dtype=np.int32).reshape(3, top_k)
            out.append((ids[:, 0].copy(), ids, np.full((3, top_k), -1.0, dtype=np.float16)))
            on_answer(3)
        return out


def test_the_warm_start_s_budget_stops_generation_and_keeps_what_it_made(tmp_path, monkeypatch):
    from train.teacher import sets
    from train.teacher.sets import warm_budget_s

    monkeypatch.setattr(sets, "SHARD_PROMPTS", 2)
    cfg = OSDConfig.model_validate({"state_dir": str(tmp_path), "model": {"target": "tiny-random"},
                                    "train": {"warm_prompts": 7, "warm_max_new_tokens": 4, "warm_budget_minutes": 0.5}})
    assert warm_budget_s(cfg) == 30.0
    target = load_target("tiny-random", progress=False)
    prompts = warm_prompts(cfg, 7)
    now = [0.0]
    teacher = SlowTeacher(now)
    got = teacher_records(cfg, target, prompts, progress=False, generate=teacher, budget_s=warm_budget_s(cfg),
                          clock=lambda: now[0])
    # Shards start at 0, 10 and 20 s of the fake clock; at 30 s the budget is spent.
    assert teacher.calls == 3 and [r.request_id for r in got] == [p.id for p in prompts[:6]]
    rest = teacher_records(cfg, target, prompts, progress=False, generate=teacher, clock=lambda: now[0])
    assert teacher.calls == 4 and [r.request_id for r in rest] == [p.id for p in prompts]


def test_warm_teacher_is_validated():
    with pytest.raises(ValueError, match="warm_teacher"):
        _cfg(2, warm_teacher="vllm")
