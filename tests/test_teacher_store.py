"""train/teacher/store.py: the teacher cache grows across runs, resumes after a kill to the
same content an uninterrupted run makes, drops damaged shards, and stops at a budget measured
on an injected clock. Pure: the answers are made-up records, no model runs."""

import hashlib
import logging

import numpy as np
import pytest
import torch

from infra.prompts import Prompt
from infra.records.schema import Record
from train.teacher.data import TeacherDataError
from train.teacher.features import Answers, FeatureRows, features_path
from train.teacher.store import TeacherStore, record_digest

pytestmark = pytest.mark.pure

PROMPTS = [Prompt(f"p{i}", f"prompt number {i}" + "!" * i, "code" if i % 3 else "math", "train") for i in range(10)]
KEY = {"target": {"spec": "tiny-random:0"}, "generator": "fake", "max_new_tokens": 8, "top_k": 4}
NEW = 8
LAYERS = (0, 2)


def answer(p: Prompt, k: int = 4) -> Record:
    """A deterministic made-up answer to p: equal prompts, equal answers, in any run."""
    rng = np.random.default_rng(int(hashlib.sha256(p.text.encode()).hexdigest()[:8], 16))
    n = int(rng.integers(1, NEW + 1))
    ids = rng.integers(0, 100, (n, k)).astype(np.int32)
    return Record(request_id=p.id, draft_version="teacher", domain=p.domain,
                  prompt_ids=np.arange(len(p.text), dtype=np.int32), output_ids=ids[:, 0].copy(), topk_ids=ids,
                  topk_logprobs=-np.sort(rng.random((n, k)), axis=1).astype(np.float16),
                  accepted=np.zeros(n, dtype=bool), draft_tokens=np.full(n, -1, dtype=np.int32),
                  draft_probs=np.full(n, np.nan, dtype=np.float32))


def rows(p: Prompt) -> FeatureRows:
    """Made-up feature rows of answer(p), as deterministic as the answer."""
    rec = answer(p)
    t = len(rec.prompt_ids) + len(rec.output_ids) - 1
    g = torch.Generator().manual_seed(int(hashlib.sha256(p.text.encode()).hexdigest()[:8], 16))
    ids = torch.from_numpy(np.concatenate([rec.prompt_ids, rec.output_ids])[:-1].astype(np.int64))
    return FeatureRows(ids, torch.randn(t, 8, generator=g).to(torch.bfloat16),
                       torch.randn(t, 4, generator=g).to(torch.bfloat16), torch.randint(0, 100, (t,), generator=g))


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Gen:
    """The build function: answers a chunk, tells the bar, and can fail or take clock time."""

    def __init__(self, fail_after=None, clock=None, seconds_per_chunk=0.0, features=False):
        self.calls, self.told = [], []
        self.fail_after, self.clock, self.seconds = fail_after, clock, seconds_per_chunk
        self.features = features  # also the features a capturing generator (the engine) returns

    def __call__(self, chunk, on_answer):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise KeyboardInterrupt("simulated kill")
        self.calls.append([p.id for p in chunk])
        if self.clock is not None:
            self.clock.t += self.seconds
        out = [answer(p) for p in chunk]
        for r in out:
            on_answer(r.n_positions)
            self.told.append(r.n_positions)
        return Answers(out, [rows(p) for p in chunk], LAYERS) if self.features else out


def fill(store, prompts, gen, **kw):
    return store.fill(prompts, gen, tokens_per_prompt=NEW, progress=False, **kw)


def digests(records):
    return [record_digest(r) for r in records]


def test_a_rerun_reads_every_answer_and_generates_nothing(tmp_path):
    store, gen = TeacherStore(tmp_path, KEY, shard_prompts=4), Gen()
    first = fill(store, PROMPTS, gen)
    assert gen.calls == [["p0", "p1", "p2", "p3"], ["p4", "p5", "p6", "p7"], ["p8", "p9"]]
    assert first.generated == 10 and not first.stopped_by_budget and len(store.shards()) == 3
    assert sorted(gen.told) == sorted(r.n_positions for r in first.records)  # the bar saw every answer
    again = fill(TeacherStore(tmp_path, KEY, shard_prompts=4), PROMPTS, Gen())
    assert again.generated == 0
    assert [r.request_id for r in again.records] == [p.id for p in PROMPTS]
    assert digests(again.records) == digests(first.records) == digests([answer(p) for p in PROMPTS])


def test_a_larger_prompt_set_generates_only_the_new_prompts(tmp_path):
    store, gen = TeacherStore(tmp_path / "a", KEY, shard_prompts=4), Gen()
    fill(store, PROMPTS[:6], gen)
    grown = fill(store, PROMPTS, gen)
    assert gen.calls[2:] == [["p6", "p7", "p8", "p9"]] and grown.generated == 4
    assert [r.request_id for r in grown.records] == [p.id for p in PROMPTS]
    at_once = TeacherStore(tmp_path / "b", KEY, shard_prompts=4)
    fill(at_once, PROMPTS, Gen())
    assert store.digest() == at_once.digest()  # other shard layout, same cache content


@pytest.mark.parametrize("features", [False, True])
def test_resuming_after_a_kill_makes_the_cache_an_uninterrupted_run_makes(tmp_path, features):
    whole = TeacherStore(tmp_path / "whole", KEY, shard_prompts=3)
    fill(whole, PROMPTS, Gen(features=features))
    cut = TeacherStore(tmp_path / "cut", KEY, shard_prompts=3)
    gen = Gen(fail_after=2, features=features)
    with pytest.raises(KeyboardInterrupt):
        fill(cut, PROMPTS, gen)
    assert len(cut.shards()) == 2  # the finished shards stay
    (cut.dir / ".shard-x.arrow.123.tmp").write_bytes(b"half a file")  # a kill during a write leaves this
    gen.fail_after = None
    resumed = fill(cut, PROMPTS, gen)
    assert gen.calls == [["p0", "p1", "p2"], ["p3", "p4", "p5"], ["p6", "p7", "p8"], ["p9"]]
    assert resumed.generated == 4
    assert cut.digest() == whole.digest()
    assert [p.name for p in cut.shards()] == [p.name for p in whole.shards()]
    for a, b in zip(cut.shards(), whole.shards()):  # shard by shard, the same answers
        assert digests(cut._read_shard(a).values()) == digests(whole._read_shard(b).values())
    if features:  # kept beside every shard, and what a resumed fill returns
        assert all(features_path(p).is_file() for p in cut.shards())
        got = fill(cut, PROMPTS, Gen(), feature_layers=LAYERS).features
        assert [f.digest() for f in got] == [rows(p).digest() for p in PROMPTS]
        bare = TeacherStore(tmp_path / "bare", KEY, shard_prompts=3)
        fill(bare, PROMPTS, Gen())
        assert bare.digest() != cut.digest()  # the features count in the content


def test_features_of_other_layers_or_damaged_are_not_used_and_the_answers_stay(tmp_path, caplog):
    store = TeacherStore(tmp_path, KEY, shard_prompts=4)
    first = fill(store, PROMPTS, Gen(features=True), feature_layers=LAYERS)
    assert [f.digest() for f in first.features] == [rows(p).digest() for p in PROMPTS]
    assert fill(store, PROMPTS, Gen(), feature_layers=(1,)).features == [None] * len(PROMPTS)
    assert fill(store, PROMPTS, Gen()).features is None  # not asked for
    damaged = features_path(store.shards()[0])
    damaged.write_bytes(damaged.read_bytes()[:100])
    gen = Gen()
    with caplog.at_level(logging.WARNING, logger="osd.teacher"):
        got = fill(store, PROMPTS, gen, feature_layers=LAYERS)
    assert any("unusable" in r.message and damaged.name in r.message for r in caplog.records)
    assert not damaged.exists() and gen.calls == []  # the answers are kept: only their features are gone
    lost = {pid for pid, _ in store._read_shard(store.shards()[0])}
    assert [f is None for f in got.features] == [p.id in lost for p in PROMPTS]
    assert digests(got.records) == digests(first.records)


def test_a_generator_whose_features_are_not_its_answers_is_refused(tmp_path):
    def wrong(chunk, on_answer):
        return Answers([answer(p) for p in chunk], [rows(p) for p in reversed(chunk)], LAYERS)

    with pytest.raises(TeacherDataError, match="features"):
        fill(TeacherStore(tmp_path, KEY), PROMPTS[:3], wrong)


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_a_damaged_shard_is_logged_deleted_and_generated_again(tmp_path, caplog, damage):
    store = TeacherStore(tmp_path, KEY, shard_prompts=4)
    fill(store, PROMPTS, Gen())
    before = store.digest()
    path = store.shards()[1]
    chunk = [pid for pid, _ in store._read_shard(path)]
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip":  # inside the data, where only the content digest can see it
        raw[len(raw) // 2] ^= 0x01
    elif damage == "garbage":
        raw = bytearray(b"not arrow at all" * 10)
    else:
        raw = bytearray()
    path.write_bytes(bytes(raw))
    gen = Gen()
    with caplog.at_level(logging.WARNING, logger="osd.teacher"):
        got = fill(store, PROMPTS, gen)
    assert any("corrupt" in r.message and path.name in r.message for r in caplog.records)
    assert gen.calls == [chunk]  # only the damaged shard's prompts
    assert [r.request_id for r in got.records] == [p.id for p in PROMPTS]
    assert store.digest() == before


def test_a_shard_of_another_setting_is_not_used(tmp_path, caplog):
    other = TeacherStore(tmp_path, {**KEY, "top_k": 8}, shard_prompts=10)
    fill(other, PROMPTS, Gen())
    store = TeacherStore(tmp_path, KEY, shard_prompts=10)
    assert store.dir != other.dir
    store.dir.mkdir()
    (store.dir / other.shards()[0].name).write_bytes(other.shards()[0].read_bytes())
    gen = Gen()
    with caplog.at_level(logging.WARNING, logger="osd.teacher"):
        fill(store, PROMPTS, gen)
    assert gen.calls == [[p.id for p in PROMPTS]] and any("key" in r.message for r in caplog.records)


def test_the_budget_stops_generation_on_the_clock_and_a_later_run_goes_on(tmp_path):
    clock = FakeClock()
    store, gen = TeacherStore(tmp_path, KEY, shard_prompts=2), Gen(clock=clock, seconds_per_chunk=10.0)
    got = fill(store, PROMPTS, gen, budget_s=25.0, clock=clock)
    # Shards start at 0, 10 and 20 s; at 30 s the budget is spent and no shard starts.
    assert gen.calls == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]]
    assert got.stopped_by_budget and got.generated == 6
    assert [r.request_id for r in got.records] == [p.id for p in PROMPTS[:6]]
    assert [r.request_id for r in store.cached(PROMPTS)] == [p.id for p in PROMPTS[:6]]
    rest = fill(store, PROMPTS, gen, budget_s=100.0, clock=clock)
    assert gen.calls[3:] == [["p6", "p7"], ["p8", "p9"]] and not rest.stopped_by_budget
    assert len(rest.records) == 10


def test_an_edited_prompt_is_answered_again(tmp_path):
    store, gen = TeacherStore(tmp_path, KEY, shard_prompts=4), Gen()
    fill(store, PROMPTS[:4], gen)
    edited = [PROMPTS[0], Prompt("p1", "another text under the same id", "code", "train"), *PROMPTS[2:4]]
    got = fill(store, edited, gen)
    assert gen.calls[1:] == [["p1"]]
    assert record_digest(got.records[1]) == record_digest(answer(edited[1]))


def test_duplicate_prompts_are_generated_once(tmp_path):
    store, gen = TeacherStore(tmp_path, KEY), Gen()
    got = fill(store, [PROMPTS[0], PROMPTS[1], PROMPTS[0]], gen)
    assert gen.calls == [["p0", "p1"]] and [r.request_id for r in got.records] == ["p0", "p1", "p0"]


def test_bad_inputs_are_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="shard_prompts"):
        TeacherStore(tmp_path, KEY, shard_prompts=0)
    with pytest.raises(TeacherDataError, match="plain JSON"):
        TeacherStore(tmp_path, {"x": object()})
    with pytest.raises(ValueError, match="budget_s"):
        fill(TeacherStore(tmp_path, KEY), PROMPTS, Gen(), budget_s=0)

    def wrong(chunk, on_answer):
        return [answer(p) for p in reversed(chunk)]

    with pytest.raises(TeacherDataError, match="not the chunk's prompts"):
        fill(TeacherStore(tmp_path, KEY), PROMPTS[:3], wrong)


def test_only_the_shards_holding_wanted_prompts_are_read(tmp_path):
    store = TeacherStore(tmp_path, KEY, shard_prompts=4)
    fill(store, PROMPTS, Gen())
    middle = [p for p in store.shards() if "p4" in [pid for pid, _ in store._read_shard(p)]][0]
    raw = bytearray(middle.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # in the data: its footer still reads
    middle.write_bytes(bytes(raw))
    assert [r.request_id for r in store.cached(PROMPTS[:4])] == ["p0", "p1", "p2", "p3"]
    assert middle.exists()  # not opened beyond its footer, so not judged
    assert [r.request_id for r in store.cached(PROMPTS)] == ["p0", "p1", "p2", "p3", "p8", "p9"]
    assert not middle.exists()
