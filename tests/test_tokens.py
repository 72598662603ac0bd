"""infra/records/tokens.py: the top-k log-probs and the EOS ids that serving and training share."""

from types import SimpleNamespace

import pytest
import torch

from infra.records.tokens import eos_token_ids, topk_logprobs

pytestmark = pytest.mark.pure


def test_topk_logprobs_are_the_top_of_the_log_softmax():
    logits = torch.randn(3, 5, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ids, lps = topk_logprobs(logits, 7)
    want_lps, want_ids = torch.log_softmax(logits, dim=-1).topk(7, dim=-1)
    assert ids.shape == (3, 5, 7) and ids.dtype == torch.int64 and lps.dtype == torch.float64
    assert torch.equal(ids, want_ids)
    assert torch.allclose(lps, want_lps, atol=1e-12)


def test_topk_over_the_whole_vocab_is_a_distribution():
    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(1)) * 5
    _, lps = topk_logprobs(logits, 11)
    assert torch.allclose(lps.exp().sum(-1), torch.ones(4), atol=1e-5)
    assert bool((lps[:, :-1] >= lps[:, 1:]).all())  # most likely first


def tok(eos):
    return SimpleNamespace(eos_token_id=eos)


@pytest.mark.parametrize("tokenizer, model_eos, explicit, want", [
    (tok(5), 9, 3, [3]),  # an explicit choice wins
    (tok(5), 9, None, [5]),  # then the tokenizer's, which the prompts were encoded with
    (tok(None), 9, None, [9]),  # then the model config's
    (None, [9, 10], None, [9, 10]),  # a list stays a list
    (None, None, (1, 2), [1, 2]),
    (tok(None), None, None, []),  # none set: nothing stops generation early
])
def test_eos_token_ids_order(tokenizer, model_eos, explicit, want):
    got = eos_token_ids(tokenizer, model_eos, explicit=explicit)
    assert got == want and all(type(e) is int for e in got)

