"""train/teacher/data.py: batched teacher generation with top-k capture, and its Arrow codec
(the on-disk cache itself: tests/test_teacher_store.py)."""

import numpy as np
import pytest
import torch

from infra.prompts import Prompt, chat_ids
from infra.records.schema import decode, encode
from infra.target import build_tiny_llama, tiny_tokenizer
from train.teacher.data import generate_teacher_records, records_to_table, table_to_records

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


# ---------------------------------------------------------------- table

def test_table_round_trip(batched):
    back = table_to_records(records_to_table(batched))
    assert len(back) == len(batched)
    for a, b in zip(batched, back):
        _same(a, b)


def test_a_progress_hook_is_told_every_answer_s_tokens(model, tok, batched):
    told = []
    recs = generate_teacher_records(model, tok, PROMPTS, max_new_tokens=NEW, top_k=K, batch_size=4,
                                    progress=told.append)
    assert sorted(told) == sorted(r.n_positions for r in recs)
    assert [r.output_ids.tolist() for r in recs] == [r.output_ids.tolist() for r in batched]
