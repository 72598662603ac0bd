"""train/distill/objective.py: the loss closure the online trainer and the warm start both step on."""

import dataclasses

import pytest
import torch

from infra.prompts import Prompt
from infra.target import build_tiny_llama, tiny_tokenizer
from train.distill.batching import pack, position_logits
from train.distill.losses import distill_loss, position_weights
from train.distill.objective import Objective, distill_loss_fn
from train.teacher.data import generate_teacher_records

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def batch():
    """Teacher records packed, with a draft proposal at every other position, accepted at every fourth."""
    target = build_tiny_llama(seed=0, num_layers=2)
    prompts = [Prompt(f"p{i}", f"tell me about {i}", "other", "train") for i in range(3)]
    recs = generate_teacher_records(target, tiny_tokenizer(), prompts, max_new_tokens=8, top_k=8, progress=False)
    b = pack(recs, 128)
    m = b.accepted.shape[0]
    pos = torch.arange(m)
    return dataclasses.replace(b, draft_tokens=torch.where(pos % 2 == 0, 7, -1), accepted=pos % 4 == 0)


@pytest.fixture(scope="module")
def draft():
    return build_tiny_llama(seed=3, num_layers=1)


def test_configured_loss_and_position_weights(batch, draft):
    tc = Objective(loss="jsd", jsd_beta=0.3, positions="mix", mix_weight=0.4)
    with torch.no_grad():
        w = position_weights(batch.accepted, batch.draft_tokens, "mix", other_weight=0.4)
        want = distill_loss(position_logits(draft, batch), batch.topk_ids, batch.topk_logprobs, kind="jsd",
                            beta=0.3, weights=w)
        got = distill_loss_fn(tc)(draft, batch)
    assert 0.0 < w.min() < w.max() == 1.0  # the batch has both weights
    assert torch.allclose(got, want)


def test_positions_override_weighs_every_position(batch, draft):
    """The warm start counts every position whatever the objective's positions say."""
    tc = Objective(loss="fkl", positions="rejected")
    with torch.no_grad():
        want = distill_loss(position_logits(draft, batch), batch.topk_ids, batch.topk_logprobs, kind="fkl")
        got = distill_loss_fn(tc, positions="all")(draft, batch)
        rejected_only = distill_loss_fn(tc)(draft, batch)
    assert torch.allclose(got, want)
    assert not torch.allclose(rejected_only, want)


def test_a_batch_without_records_steps_with_zero_gradients(batch, draft):
    """The trainer's null batch (a rank without data) must leave the weights where they are."""
    draft.zero_grad()
    loss = distill_loss_fn(Objective(positions="all"))(draft, dataclasses.replace(batch, n_records=0))
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert all(p.grad is None or not p.grad.any() for p in draft.parameters())


def test_the_kl_anchor_is_zero_at_the_parent_and_pulls_back_towards_it(batch, draft):
    """The KL anchor (`osd bench adapt`): base loss + weight x KL(parent || draft). At the parent itself the KL
    term is 0; away from it the term is positive, and a step on it alone moves the draft's
    distribution back towards the parent's."""
    import copy

    from train.distill.objective import anchored_loss_fn

    base = distill_loss_fn(positions="all")
    parent = copy.deepcopy(draft).eval().requires_grad_(False)
    with torch.no_grad():
        assert torch.allclose(anchored_loss_fn(base, parent, 2.0)(draft, batch), base(draft, batch), atol=1e-6)
    moved = copy.deepcopy(draft)
    with torch.no_grad():
        moved.lm_head.weight.add_(0.05 * torch.randn_like(moved.lm_head.weight))
    kl_only = anchored_loss_fn(lambda m, b: torch.zeros(()), parent, 1.0)
    before = kl_only(moved, batch)
    assert before > 0
    opt = torch.optim.SGD([moved.lm_head.weight], lr=0.02)  # the weights that were moved
    for _ in range(3):
        opt.zero_grad()
        kl_only(moved, batch).backward()
        opt.step()
    assert kl_only(moved, batch) < before


def test_the_default_objective_is_forward_kl_at_every_position():
    assert (Objective().loss, Objective().positions) == ("fkl", "all")
    with pytest.raises(ValueError, match="jsd_beta"):
        Objective(loss="jsd", jsd_beta=1.0)
    with pytest.raises(ValueError, match="loss is one of"):
        Objective(loss="kl")
