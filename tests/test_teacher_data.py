"""train/teacher_data.py: batched teacher generation with top-k capture, and its disk cache."""

import logging

import numpy as np
import pytest
import torch

from infra.prompts import Prompt, chat_ids
from infra.records import decode, encode
from infra.target import build_tiny_llama, tiny_tokenizer
from train.teacher_data import (
    TeacherCache,
    cached_teacher_records,
    generate_teacher_records,
    records_to_table,
    table_to_records,
    teacher_cache_key,
)

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]

TEXTS = ["hi", "hello world, how are you today?", "a", "what is 2+2? tell me", "write a poem about the sea",
         "ok then"]
PROMPTS = [Prompt(f"p{i}", t, "math" if "2+2" in t else "other", "train") for i, t in enumerate(TEXTS)]
NEW = 12
K = 8


@pytest.fixture(scope="module")
def model():
    return build_tiny_llama(seed=0, num_layers=2)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def batched(model, tok):
    return generate_teacher_records(model, tok, PROMPTS, max_new_tokens=NEW, top_k=K, batch_size=4, progress=False)


def _hf_greedy(model, tok, text, eos=None):
    ids = torch.tensor([chat_ids(tok, text)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                         eos_token_id=eos, pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def _same(a, b, ids_too=True):
    assert a.request_id == b.request_id and a.domain == b.domain and a.draft_version == b.draft_version
    assert a.record_id == b.record_id and a.created_at == b.created_at
    for f in ("prompt_ids", "output_ids", "topk_ids", "accepted", "draft_tokens"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert np.array_equal(a.topk_logprobs, b.topk_logprobs)
    assert np.array_equal(a.draft_probs, b.draft_probs, equal_nan=True)


# ---------------------------------------------------------------- generation

def test_records_shape_and_fields(batched, tok):
    assert [r.request_id for r in batched] == [p.id for p in PROMPTS]
    for r, p in zip(batched, PROMPTS):
        assert r.draft_version == "teacher" and r.domain == p.domain
        assert r.prompt_ids.tolist() == chat_ids(tok, p.text)
        n = r.n_positions
        assert r.topk_ids.shape == (n, K) and r.topk_logprobs.dtype == np.float16
        assert not r.accepted.any() and (r.draft_tokens == -1).all() and np.isnan(r.draft_probs).all()
        assert decode(encode(r)).n_positions == n  # a valid record


def test_batched_equals_unbatched_and_hf_greedy(model, tok, batched):
    for bs in (1, 3, 16):
        other = generate_teacher_records(model, tok, PROMPTS, max_new_tokens=NEW, top_k=K, batch_size=bs,
                                         progress=False)
        for a, b in zip(batched, other):
            assert a.output_ids.tolist() == b.output_ids.tolist()
            assert np.array_equal(a.topk_ids, b.topk_ids)
            np.testing.assert_allclose(a.topk_logprobs.astype(np.float32), b.topk_logprobs.astype(np.float32),
                                       atol=1e-2, rtol=1e-3)
    for r, p in zip(batched, PROMPTS):
        assert r.output_ids.tolist() == _hf_greedy(model, tok, p.text, eos=tok.eos_token_id)[: r.n_positions]


def test_topk_matches_an_independent_forward(model, batched):
    for r in batched:
        seq = torch.tensor(np.concatenate([r.prompt_ids, r.output_ids]), dtype=torch.long)[None]
        with torch.no_grad():
            logits = model(seq).logits[0].float()
        p = len(r.prompt_ids)
        rows = logits[p - 1 : p - 1 + r.n_positions]  # the distribution each output token came from
        lps = torch.log_softmax(rows, dim=-1)
        vals, ids = torch.topk(lps, K, dim=-1)
        assert np.array_equal(ids.numpy(), r.topk_ids)
        np.testing.assert_allclose(r.topk_logprobs.astype(np.float32), vals.numpy(), atol=1e-2, rtol=1e-3)
        assert (r.topk_ids[:, 0] == r.output_ids).all()  # greedy picks the top-1
        assert (r.topk_logprobs <= 0).all()


def test_eos_trims_and_keeps_the_eos(model, tok, batched):
    # Declare a token that prompt 0 emits mid-way as the stop token.
    full = batched[0].output_ids.tolist()
    assert len(full) == NEW
    stop = full[4]
    cut = full.index(stop) + 1
    recs = generate_teacher_records(model, tok, PROMPTS, max_new_tokens=NEW, top_k=K, batch_size=6,
                                    progress=False, eos_token_id=stop)
    assert recs[0].output_ids.tolist() == full[:cut]
    assert recs[0].topk_ids.shape == (cut, K)
    for r, ref in zip(recs, batched):
        out = r.output_ids.tolist()
        if stop in out:
            assert out.index(stop) == len(out) - 1  # ends at its first EOS, no pad after
        assert out == ref.output_ids.tolist()[: len(out)]
        assert out == _hf_greedy(model, tok, TEXTS[int(r.request_id[1:])], eos=stop)[: len(out)]
        assert np.array_equal(r.topk_ids, ref.topk_ids[: len(out)])
    assert any(len(r.output_ids) < NEW for r in recs)


# ---------------------------------------------------------------- table + cache

def test_table_round_trip(batched):
    back = table_to_records(records_to_table(batched))
    assert len(back) == len(batched)
    for a, b in zip(batched, back):
        _same(a, b)


class Counter:
    def __init__(self, records, fail_after=None):
        self.records = {r.request_id: r for r in records}
        self.calls = []
        self.fail_after = fail_after

    def __call__(self, chunk=None):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise KeyboardInterrupt("simulated interruption")
        items = PROMPTS if chunk is None else chunk
        self.calls.append([p.id for p in items])
        return [self.records[p.id] for p in items]


KEY = {"target": {"spec": "tiny-random:0"}, "prompts": "abc", "max_new_tokens": NEW, "top_k": K}


def test_cache_hit_returns_equal_records_without_building(tmp_path, batched):
    cache = TeacherCache(tmp_path, progress=False)
    build = Counter(batched)
    first = cache.get_or_build(KEY, build)
    assert len(build.calls) == 1
    again = TeacherCache(tmp_path, progress=False).get_or_build(KEY, build)
    assert len(build.calls) == 1
    for a, b in zip(batched, again):
        _same(a, b)
    assert first is not again
    assert [p.name for p in tmp_path.iterdir()] == [f"{TeacherCache.key(KEY)}.arrow"]


def test_key_is_canonical_and_changes_rebuild(tmp_path, batched):
    cache = TeacherCache(tmp_path, progress=False)
    build = Counter(batched)
    cache.get_or_build(KEY, build)
    cache.get_or_build(dict(reversed(list(KEY.items()))), build)  # same key, other order
    assert len(build.calls) == 1
    for change in ({"top_k": 4}, {"max_new_tokens": 13}, {"prompts": "abd"}, {"target": {"spec": "x"}}):
        cache.get_or_build({**KEY, **change}, build)
    assert len(build.calls) == 5
    assert len(list(tmp_path.glob("*.arrow"))) == 5


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_corrupt_file_is_logged_and_rebuilt(tmp_path, batched, caplog, damage):
    cache = TeacherCache(tmp_path, progress=False)
    build = Counter(batched)
    cache.get_or_build(KEY, build)
    path = cache.path(KEY)
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
    with caplog.at_level(logging.WARNING, logger="osd.teacher"):
        got = cache.get_or_build(KEY, build)
    assert len(build.calls) == 2
    assert any("corrupt" in r.message and path.name in r.message for r in caplog.records)
    for a, b in zip(batched, got):
        _same(a, b)
    for a, b in zip(batched, cache.get_or_build(KEY, build)):  # the rebuilt file is whole
        _same(a, b)
    assert len(build.calls) == 2


def test_chunked_build_resumes_after_an_interruption(tmp_path, batched, caplog):
    cache = TeacherCache(tmp_path, chunk_size=2, progress=False)
    build = Counter(batched, fail_after=1)  # first chunk completes, then "Ctrl-C"
    with pytest.raises(KeyboardInterrupt):
        cache.get_or_build(KEY, build, items=PROMPTS)
    assert build.calls == [["p0", "p1"]]
    key = TeacherCache.key(KEY)
    assert (tmp_path / f"{key}.part-0.arrow").is_file() and not cache.path(KEY).exists()
    build.fail_after = None
    got = cache.get_or_build(KEY, build, items=PROMPTS)
    assert build.calls == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]]  # chunk 0 not recomputed
    for a, b in zip(batched, got):
        _same(a, b)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{key}.arrow"]  # parts assembled and removed
    assert len(cache.get_or_build(KEY, build, items=PROMPTS)) == len(PROMPTS)
    assert len(build.calls) == 3


def test_corrupt_or_relaid_part_is_rebuilt(tmp_path, batched):
    cache = TeacherCache(tmp_path, progress=False)
    build = Counter(batched, fail_after=2)
    with pytest.raises(KeyboardInterrupt):
        cache.get_or_build(KEY, build, items=PROMPTS, chunk_size=2)
    key = TeacherCache.key(KEY)
    part1 = tmp_path / f"{key}.part-1.arrow"
    part1.write_bytes(part1.read_bytes()[:-40])
    build.fail_after = None
    cache.get_or_build(KEY, build, items=PROMPTS, chunk_size=2)
    assert build.calls[2:] == [["p2", "p3"], ["p4", "p5"]]
    # Parts of another chunk size are not reused.
    cache2 = TeacherCache(tmp_path / "b", progress=False)
    build2 = Counter(batched, fail_after=1)
    with pytest.raises(KeyboardInterrupt):
        cache2.get_or_build(KEY, build2, items=PROMPTS, chunk_size=2)
    build2.fail_after = None
    cache2.get_or_build(KEY, build2, items=PROMPTS, chunk_size=3)
    assert build2.calls == [["p0", "p1"], ["p0", "p1", "p2"], ["p3", "p4", "p5"]]


def test_cached_teacher_records_end_to_end(tmp_path, model, tok, batched):
    cache = TeacherCache(tmp_path, chunk_size=4, progress=False)
    ref = {"spec": "tiny-random:0", "sha256": None}
    a = cached_teacher_records(model, tok, PROMPTS, cache=cache, target_ref=ref, max_new_tokens=NEW, top_k=K)
    b = cached_teacher_records(model, tok, PROMPTS, cache=cache, target_ref=ref, max_new_tokens=NEW, top_k=K)
    for x, y, z in zip(a, b, batched):
        _same(x, y)
        assert x.output_ids.tolist() == z.output_ids.tolist()
    key = teacher_cache_key(ref, PROMPTS, max_new_tokens=NEW, top_k=K, dtype="float32")
    assert cache.path(key).is_file()
    other = teacher_cache_key(ref, PROMPTS[:-1], max_new_tokens=NEW, top_k=K, dtype="float32")
    assert TeacherCache.key(other) != TeacherCache.key(key)
