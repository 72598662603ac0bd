"""serve/sampling/verify.py: the acceptance rules, as pure functions over small tensors."""

import pytest
import torch

from chi2 import chi2_pvalue
from serve.sampling.verify import SamplingParams, residual, sample, verify_greedy, verify_sampling, warp_probs

pytestmark = pytest.mark.pure


# ---------------------------------------------------------------- greedy


def test_verify_greedy_all_accepted_gives_bonus():
    drafts = torch.tensor([3, 1, 4])
    assert verify_greedy(drafts, torch.tensor([3, 1, 4, 7])) == (3, 7)


@pytest.mark.parametrize("i", [0, 1, 2])
def test_verify_greedy_mismatch_at_position(i):
    drafts = torch.tensor([3, 1, 4])
    target = torch.tensor([3, 1, 4, 7])
    target[i] = 9
    # A later agreement after the mismatch must not count.
    assert verify_greedy(drafts, target) == (i, 9)


def test_verify_greedy_k0_emits_target_argmax():
    assert verify_greedy(torch.empty(0, dtype=torch.long), torch.tensor([5])) == (0, 5)


# ---------------------------------------------------------------- sampling rules


def _rand_probs(rows: int, v: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, v, generator=g) * 2, dim=-1)


def test_verify_sampling_p_equals_q_accepts_everything():
    k, v = 4, 10
    p = _rand_probs(k + 1, v, 0)
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        drafts = torch.multinomial(p[:k], 1, generator=g).view(k)
        n, nxt = verify_sampling(drafts, p[:k].clone(), p, g)
        assert n == k
        assert 0 <= nxt < v


def test_verify_sampling_k0_samples_from_p():
    p = torch.zeros(1, 6)
    p[0, 4] = 1.0
    g = torch.Generator().manual_seed(0)
    assert verify_sampling(torch.empty(0, dtype=torch.long), torch.zeros(0, 6), p, g) == (0, 4)


def test_verify_sampling_rejects_tokens_the_target_excludes():
    v = 6
    p = torch.tensor([[0.0, 0.1, 0.2, 0.3, 0.4, 0.0], [0.2] * 5 + [0.0]])
    q = torch.zeros(1, v)
    q[0, 0] = 0.9
    q[0, 5] = 0.1  # all of q's mass is where p is zero
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(300):
        d = torch.multinomial(q[0], 1, generator=g)
        n, nxt = verify_sampling(d, q, p, g)
        assert n == 0
        assert nxt not in (0, 5)
        seen.add(nxt)
    assert seen == {1, 2, 3, 4}


def test_residual_is_normalised_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.1, 0.6, 0.1, 0.2])
    r = residual(p, q)
    assert torch.allclose(r, torch.tensor([0.8, 0.0, 0.2, 0.0]))
    assert torch.isclose(r.sum(), torch.tensor(1.0))
    p2, q2 = _rand_probs(1, 50, 3)[0], _rand_probs(1, 50, 4)[0]
    r2 = residual(p2, q2)
    assert (r2 >= 0).all() and torch.isclose(r2.sum(), torch.tensor(1.0))
    assert ((r2 > 0) == (p2 > q2)).all()
    # No residual mass (p == q): falls back to p.
    assert torch.equal(residual(p, p.clone()), p)


def test_sample_draws_from_probs():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.0, 0.0, 1.0])
    assert {sample(probs, g) for _ in range(20)} == {2}


# ---------------------------------------------------------------- warping


def test_warp_temperature():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    for t in (0.3, 1.0, 2.5):
        got = warp_probs(logits, SamplingParams(temperature=t))
        assert got.dtype == torch.float32
        assert torch.allclose(got, torch.softmax(logits / t, dim=-1), atol=1e-6)
    # temperature 0 (greedy) leaves logits unscaled.
    assert torch.allclose(warp_probs(logits, SamplingParams()), torch.softmax(logits, -1), atol=1e-6)


def test_warp_top_k_keeps_exactly_the_k_largest():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    probs = warp_probs(logits, SamplingParams(temperature=0.7, top_k=5))
    for row, lg in zip(probs, logits):
        kept = set(torch.nonzero(row).flatten().tolist())
        assert kept == set(torch.topk(lg, 5).indices.tolist())
        ref = torch.softmax(lg[sorted(kept)] / 0.7, -1)
        assert torch.allclose(row[sorted(kept)], ref, atol=1e-6)
    # top_k >= V is a no-op.
    assert torch.allclose(warp_probs(logits, SamplingParams(temperature=1.0, top_k=30)), torch.softmax(logits, -1))


def test_warp_top_p_keeps_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15]))
    # sorted: 0.4, 0.3, 0.15, 0.1, 0.05 -> cumulative 0.4, 0.7, 0.85, ...
    for top_p, kept in [(0.35, {1}), (0.5, {1, 3}), (0.65, {1, 3}), (0.8, {1, 3, 4}), (0.99, {1, 2, 3, 4, 0})]:
        probs = warp_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        assert set(torch.nonzero(probs).flatten().tolist()) == kept, top_p
        mass = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])[sorted(kept)]
        assert torch.allclose(probs[sorted(kept)], mass / mass.sum(), atol=1e-6)
    # The top token always survives, however small top_p is.
    probs = warp_probs(logits.expand(3, 5), SamplingParams(temperature=1.0, top_p=1e-9))
    assert torch.equal(probs, torch.nn.functional.one_hot(torch.tensor([1, 1, 1]), 5).float())


def test_warp_order_temperature_then_top_k_then_top_p():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    params = SamplingParams(temperature=0.5, top_k=4, top_p=0.9)
    x = logits / 0.5
    x[4] = float("-inf")  # top-k 4
    p = torch.softmax(x, -1)  # [0.831, 0.112, 0.041, 0.015, 0]: top-p 0.9 keeps tokens 0, 1
    assert p[0] < 0.9 < p[0] + p[1]
    expected = torch.zeros(5)
    expected[:2] = torch.softmax(x[:2], -1)
    assert torch.allclose(warp_probs(logits, params), expected, atol=1e-6)


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.1)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-1)
    for bad in (0.0, -0.5, 1.01):
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(top_p=bad)
    assert SamplingParams().greedy and not SamplingParams(temperature=0.8).greedy
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0)  # the disabled values are valid


# ---------------------------------------------------------------- statistics


def _emitted_counts(verifier, p, q, trials, seed):
    """Run `verifier` on drafts drawn from q; count the first emitted token, and the
    second one on the trials that accepted the first draft."""
    k, v = q.shape
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, trials, replacement=True, generator=g).T.contiguous()  # [trials, k]
    first = torch.zeros(v, dtype=torch.long)
    second = torch.zeros(v, dtype=torch.long)
    n_acc = torch.zeros(k + 1, dtype=torch.long)
    for d in drafts:
        n, nxt = verifier(d, q, p, g)
        out = d[:n].tolist() + [nxt]
        n_acc[n] += 1
        first[out[0]] += 1
        if n >= 1:
            second[out[1]] += 1
    return first, second, n_acc


P_FIXED = torch.tensor(
    [
        [0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
        [0.05, 0.05, 0.30, 0.30, 0.10, 0.20],
        [0.10, 0.20, 0.30, 0.20, 0.10, 0.10],
    ]
)
Q_FIXED = torch.tensor(
    [
        [0.05, 0.10, 0.15, 0.20, 0.25, 0.25],  # mostly where p[0] is small: many rejections
        [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
    ]
)
TRIALS = 8000


def test_verify_sampling_first_token_follows_p():
    first, second, n_acc = _emitted_counts(verify_sampling, P_FIXED, Q_FIXED, TRIALS, seed=1234)
    # The residual path and the accept path were both taken many times.
    assert n_acc[0] > 1000 and n_acc[1:].sum() > 1000
    assert chi2_pvalue(first, P_FIXED[0]) > 1e-3
    # Given the first draft was accepted, the second token follows p[1] (fixed rows here).
    assert chi2_pvalue(second, P_FIXED[1]) > 1e-3


def test_statistical_test_catches_a_wrong_rule():
    """The same test at the same size rejects a verifier that resamples from p instead of
    the residual (a classic bug that biases output toward q's tokens)."""

    def wrong(drafts, q, p, g):
        n, _ = verify_sampling(drafts, q, p, g)
        return n, sample(p[n], g)

    first, _, _ = _emitted_counts(wrong, P_FIXED, Q_FIXED, TRIALS, seed=1234)
    assert chi2_pvalue(first, P_FIXED[0]) < 1e-6


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-40])
def test_tiny_top_p_keeps_the_most_likely_token(top_p):
    """Found by schemathesis (issue 18): top_p = 5e-324 rounds to 0 in float32, dropped every
    token, and the NaN draw was a 500. However small top_p is, the top token remains."""
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5]])
    probs = warp_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-40, 9e-6])
def test_tiny_temperature_is_greedy(temperature):
    """A temperature this small overflowed the logits to inf and the NaN draw was a 500."""
    params = SamplingParams(temperature=temperature)
    assert params.greedy
    assert not SamplingParams(temperature=1e-4).greedy
