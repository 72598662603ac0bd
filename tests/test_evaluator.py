"""train/gate/evaluator.py: the held-out split and α_est, the acceptance estimate of a candidate."""

import math

import pytest
import torch

from infra.prompts import Prompt
from infra.target import build_tiny_llama, tiny_tokenizer
from train.distill.batching import pack, position_logits
from train.gate.evaluator import estimate_alpha, is_held_out
from train.distill.losses import expected_acceptance
from train.teacher.data import generate_teacher_records

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]

VOCAB = 259  # the tiny target's; a top-k that wide makes the lower bound the exact acceptance


@pytest.fixture(scope="module")
def target():
    return build_tiny_llama(seed=0, num_layers=2)


@pytest.fixture(scope="module")
def records(target):
    prompts = [Prompt(f"p{i}", f"question number {i}?" * (1 + i % 3), "other", "train") for i in range(10)]
    return generate_teacher_records(target, tiny_tokenizer(), prompts, max_new_tokens=6, top_k=VOCAB,
                                    progress=False)


def test_held_out_is_stable_and_one_in_every():
    ids = [f"rec-{i}" for i in range(3000)]
    picked = [is_held_out(r, 6) for r in ids]
    assert picked == [is_held_out(r, 6) for r in ids]  # a restart picks the same records
    assert abs(sum(picked) / len(ids) - 1 / 6) < 0.03
    assert all(is_held_out(r, 1) for r in ids[:50])


def test_alpha_of_no_records_is_none(target):
    assert estimate_alpha(target, [], 128) is None


def test_target_as_its_own_draft_is_accepted_almost_always(target, records):
    alpha = estimate_alpha(target, records, 128)
    assert 0.99 < alpha <= 1.0 + 1e-6  # only the records' fp16 log-probs keep it off 1


def test_another_model_scores_lower(target, records):
    other = build_tiny_llama(seed=1, num_layers=1)
    alpha = estimate_alpha(other, records, 128)
    assert 0.0 < alpha < estimate_alpha(target, records, 128)


def test_alpha_is_the_mean_over_positions_not_over_chunks(records):
    """More than one chunk of records: every position weighs the same, however they are chunked."""
    draft = build_tiny_llama(seed=2, num_layers=1)
    assert len(records) > 8
    with torch.no_grad():
        b = pack(records, 128)
        want = float(expected_acceptance(position_logits(draft, b), b.topk_ids, b.topk_logprobs).lower.mean())
    draft.train()
    assert math.isclose(estimate_alpha(draft, records, 128), want, rel_tol=1e-5)
    assert not draft.training  # evaluated without dropout
