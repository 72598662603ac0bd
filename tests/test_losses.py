"""train/distill/losses.py: distillation losses on the K+1 bucket partition (top-K + OTHER)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from train.distill.losses import (
    Acceptance,
    collapse,
    distill_loss,
    expected_acceptance,
    forward_kl,
    jsd,
    per_position,
    position_weights,
    reverse_kl,
    total_variation,
)

pytestmark = pytest.mark.pure

ALL = ("fkl", "rkl", "jsd", "tv")


def _t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


def _rand_dist(g, n, v, scale=2.0, dtype=torch.float64):
    return torch.softmax(torch.randn(n, v, generator=g, dtype=dtype) * scale, -1)


def _sparse(p_full, k):
    """The target's top-k ids and log-probs, as a record stores them."""
    lp, ids = torch.topk(p_full.log(), k, -1)
    return ids, lp


# --- hand-computed example: V=5, K=2, tail 0.2; the draft puts 0.4 on the tail tokens ----------

# target: p[3]=0.5, p[1]=0.3, tail 0.2 (on tokens 0, 2, 4 - unknown)
# draft:  q = [0.1, 0.2, 0.1, 0.4, 0.2] -> buckets (q3, q1, other) = (0.4, 0.2, 0.4)
P_B = (0.5, 0.3, 0.2)
Q_B = (0.4, 0.2, 0.4)


def _example(dtype=torch.float64):
    logits = _t([[0.1, 0.2, 0.1, 0.4, 0.2]]).log().to(dtype) + 3.0  # shift: logits, not log-probs
    ids = torch.tensor([[3, 1]], dtype=torch.int32)
    lp = _t([[math.log(0.5), math.log(0.3)]])
    return logits, ids, lp


def _kl(a, b):
    return sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)


def test_collapse_buckets_on_example():
    b = collapse(*_example())
    assert torch.allclose(b.logp.exp(), _t([P_B]), atol=1e-12)
    assert torch.allclose(b.logq.exp(), _t([Q_B]), atol=1e-12)


def test_divergences_match_hand_computed_values():
    args = _example()
    fkl = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.2) + 0.2 * math.log(0.2 / 0.4)
    rkl = 0.4 * math.log(0.4 / 0.5) + 0.2 * math.log(0.2 / 0.3) + 0.4 * math.log(0.4 / 0.2)
    m = (0.45, 0.25, 0.3)
    js = 0.5 * _kl(P_B, m) + 0.5 * _kl(Q_B, m)
    beta = 0.2
    m2 = tuple(beta * p + (1 - beta) * q for p, q in zip(P_B, Q_B))
    js2 = beta * _kl(P_B, m2) + (1 - beta) * _kl(Q_B, m2)
    assert forward_kl(*args).item() == pytest.approx(fkl, abs=1e-12)
    assert reverse_kl(*args).item() == pytest.approx(rkl, abs=1e-12)
    assert jsd(*args).item() == pytest.approx(js, abs=1e-12)
    assert jsd(*args, beta=beta).item() == pytest.approx(js2, abs=1e-12)
    assert total_variation(*args).item() == pytest.approx(0.2, abs=1e-12)  # .5(.1+.1+.2)
    acc = expected_acceptance(*args)
    assert isinstance(acc, Acceptance)
    assert acc.lower.item() == pytest.approx(0.6, abs=1e-12)  # min(.5,.4) + min(.3,.2)
    assert acc.upper.item() == pytest.approx(0.8, abs=1e-12)  # + min(.2, .4)
    # the tail bucket matters: drop it and fkl changes
    assert fkl != pytest.approx(0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.2))


def test_fp32_and_fp16_inputs_match_float64_reference():
    logits, ids, lp = _example()
    ref = forward_kl(logits, ids, lp).item()
    out = forward_kl(logits.to(torch.bfloat16), ids.long(), lp.half())
    assert out.dtype == torch.float32
    assert out.item() == pytest.approx(ref, abs=2e-2)  # bf16 logits, fp16 log-probs
    assert forward_kl(logits.float(), ids, lp.float()).item() == pytest.approx(ref, abs=1e-6)


def test_vectorised_over_positions_and_leading_dims():
    g = torch.Generator().manual_seed(0)
    p, q = _rand_dist(g, 6, 9), _rand_dist(g, 6, 9)
    ids, lp = _sparse(p, 3)
    logits = q.log()
    for kind in ALL:
        full = per_position(logits, ids, lp, kind)
        rows = torch.cat([per_position(logits[i:i + 1], ids[i:i + 1], lp[i:i + 1], kind) for i in range(6)])
        assert torch.allclose(full, rows, atol=1e-12), kind
        batched = per_position(logits.view(2, 3, 9), ids.view(2, 3, 3), lp.view(2, 3, 3), kind)
        assert torch.allclose(batched.view(6), full, atol=1e-12), kind


# --- identities --------------------------------------------------------------------------------


def test_zero_when_draft_equals_target_on_buckets():
    g = torch.Generator().manual_seed(1)
    p = _rand_dist(g, 4, 10)
    ids, lp = _sparse(p, 4)
    # same top-k probabilities and same OTHER mass, but a different shape inside the tail
    q = p.clone()
    outside = torch.ones_like(p, dtype=torch.bool).scatter_(-1, ids, False)
    tail = (p * outside).sum(-1, keepdim=True)
    w = torch.rand(4, 10, generator=g, dtype=torch.float64) * outside
    q = torch.where(outside, tail * w / w.sum(-1, keepdim=True), p)
    assert not torch.allclose(q, p)
    for kind in ALL:
        assert per_position(q.log(), ids, lp, kind).abs().max().item() < 1e-12, kind
    acc = expected_acceptance(q.log(), ids, lp)
    assert torch.allclose(acc.upper, torch.ones(4, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(acc.lower, lp.exp().sum(-1), atol=1e-12)


def test_fkl_rkl_asymmetric_and_nonnegative():
    args = _example()
    assert forward_kl(*args).item() != pytest.approx(reverse_kl(*args).item(), abs=1e-3)
    g = torch.Generator().manual_seed(2)
    p, q = _rand_dist(g, 50, 12), _rand_dist(g, 50, 12)
    ids, lp = _sparse(p, 4)
    for kind in ALL:
        assert per_position(q.log(), ids, lp, kind).min().item() >= -1e-12, kind


def test_jsd_symmetric_at_half_and_bounded_by_binary_entropy():
    g = torch.Generator().manual_seed(3)
    p, q = _rand_dist(g, 20, 7, scale=4.0), _rand_dist(g, 20, 7, scale=4.0)
    # full top-k so that the roles can be swapped exactly
    pq = jsd(q.log(), *_sparse(p, 7))
    qp = jsd(p.log(), *_sparse(q, 7))
    assert torch.allclose(pq, qp, atol=1e-12)
    assert not torch.allclose(jsd(q.log(), *_sparse(p, 7), beta=0.3), jsd(p.log(), *_sparse(q, 7), beta=0.3))
    # disjoint supports: JSD_beta reaches the binary entropy H(beta) (log 2 at 0.5), never more
    logits = _t([[0.0, 0.0, -1e4, -1e4]])
    ids, lp = torch.tensor([[2, 3]]), _t([[math.log(0.5), math.log(0.5)]])
    for beta in (0.1, 0.5, 0.8):
        h = -beta * math.log(beta) - (1 - beta) * math.log(1 - beta)
        assert jsd(logits, ids, lp, beta=beta).item() == pytest.approx(h, abs=1e-9)
        ids2, lp2 = _sparse(p, 3)
        assert jsd(q.log(), ids2, lp2, beta=beta).max().item() <= h + 1e-12
    assert total_variation(logits, ids, lp).item() == pytest.approx(1.0, abs=1e-9)


def test_tv_in_unit_interval():
    g = torch.Generator().manual_seed(4)
    p, q = _rand_dist(g, 100, 15, scale=5.0), _rand_dist(g, 100, 15, scale=5.0)
    tv = total_variation(q.log(), *_sparse(p, 5))
    assert tv.min().item() >= 0.0 and tv.max().item() <= 1.0
    assert tv.max().item() > 0.3  # not trivially zero


def test_jsd_limits_in_beta():
    args = _example()
    fkl, rkl = forward_kl(*args).item(), reverse_kl(*args).item()
    for beta in (1e-3, 1e-5):
        v = jsd(*args, beta=beta).item()
        assert v == pytest.approx(beta * fkl, rel=5 * beta ** 0.5 + 1e-3)
    for beta in (1 - 1e-3, 1 - 1e-5):
        v = jsd(*args, beta=beta).item()
        assert v == pytest.approx((1 - beta) * rkl, rel=5 * (1 - beta) ** 0.5 + 1e-3)
    assert jsd(*args, beta=1e-6).item() < 1e-5 and jsd(*args, beta=1 - 1e-6).item() < 1e-5
    with pytest.raises(ValueError, match="beta"):
        jsd(*args, beta=1.0)


def test_full_topk_equals_exact_full_vocab():
    g = torch.Generator().manual_seed(5)
    p, q = _rand_dist(g, 8, 11, scale=3.0), _rand_dist(g, 8, 11, scale=3.0)
    ids, lp = _sparse(p, 11)  # K = V, ids permuted (sorted by p)
    logits = q.log() + 7.0
    lq, lpf = torch.log_softmax(logits, -1), p.log()
    fkl_ref = F.kl_div(lq, lpf, log_target=True, reduction="none").sum(-1)
    rkl_ref = F.kl_div(lpf, lq, log_target=True, reduction="none").sum(-1)
    m = 0.3 * p + 0.7 * q
    jsd_ref = 0.3 * (p * (p / m).log()).sum(-1) + 0.7 * (q * (q / m).log()).sum(-1)
    tv_ref = 0.5 * (p - q).abs().sum(-1)
    assert torch.allclose(forward_kl(logits, ids, lp), fkl_ref, atol=1e-12)
    assert torch.allclose(reverse_kl(logits, ids, lp), rkl_ref, atol=1e-12)
    assert torch.allclose(jsd(logits, ids, lp, beta=0.3), jsd_ref, atol=1e-12)
    assert torch.allclose(total_variation(logits, ids, lp), tv_ref, atol=1e-12)
    acc = expected_acceptance(logits, ids, lp)
    exact = torch.minimum(p, q).sum(-1)
    assert torch.allclose(acc.lower, exact, atol=1e-12) and torch.allclose(acc.upper, exact, atol=1e-12)


def test_buckets_lower_bound_full_vocab_divergences():
    """Data-processing inequality: collapsing onto K+1 buckets never increases a divergence."""
    g = torch.Generator().manual_seed(6)
    p, q = _rand_dist(g, 64, 20, scale=3.0), _rand_dist(g, 64, 20, scale=3.0)
    ids, lp = _sparse(p, 4)
    lq = q.log()
    fkl_full = (p * (p / q).log()).sum(-1)
    rkl_full = (q * (q / p).log()).sum(-1)
    tv_full = 0.5 * (p - q).abs().sum(-1)
    m = 0.5 * (p + q)
    jsd_full = 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)
    assert (forward_kl(lq, ids, lp) <= fkl_full + 1e-12).all()
    assert (reverse_kl(lq, ids, lp, tail_floor=0.0) <= rkl_full + 1e-12).all()
    assert (total_variation(lq, ids, lp) <= tv_full + 1e-12).all()
    assert (jsd(lq, ids, lp) <= jsd_full + 1e-12).all()
    assert (forward_kl(lq, ids, lp) < fkl_full - 1e-6).any()  # strictly lossy somewhere
    exact = torch.minimum(p, q).sum(-1)
    acc = expected_acceptance(lq, ids, lp)
    assert (acc.lower <= exact + 1e-12).all() and (exact <= acc.upper + 1e-12).all()
    assert (acc.lower < acc.upper).any()
    assert torch.allclose(acc.upper, 1 - total_variation(lq, ids, lp), atol=1e-12)


# --- tail edge cases and gradients -------------------------------------------------------------


def _edge_batch():
    """fp16 log-probs; rows: tail exactly 0, known mass > 1 by fp16 rounding, ordinary tail,
    extreme logits (draft puts ~exp(-2e4) on OTHER while the target has tail 0.5)."""
    V = 6
    logits = torch.tensor([
        [1e4, -1e4, 0.0, 3.0, -2.0, 1.0],
        [0.0, 1.0, 2.0, -1e4, 1e4, 0.5],
        [-1e4, -1e4, -1e4, -1e4, -1e4, 1e4],
        [1e4, 1e4, -1e4, -1e4, -1e4, -1e4],
    ], dtype=torch.float32, requires_grad=True)
    ids = torch.tensor([[2, 4], [0, 1], [5, 0], [0, 1]], dtype=torch.int32)
    lp = torch.tensor([
        [0.0, -30.0],  # tail exactly 0 (mass on OTHER for the draft)
        [math.log(0.6), math.log(0.4004)],  # sums to > 1
        [math.log(0.7), math.log(0.1)],
        [math.log(0.25), math.log(0.25)],  # tail 0.5, draft's OTHER mass ~exp(-2e4)
    ], dtype=torch.float16)
    assert logits.shape[-1] == V
    return logits, ids, lp


@pytest.mark.parametrize("kind", ALL)
def test_finite_values_and_gradients_at_the_edges(kind):
    logits, ids, lp = _edge_batch()
    d = per_position(logits, ids, lp, kind)
    assert torch.isfinite(d).all(), d
    assert (d >= -1e-5).all(), d
    d.sum().backward()
    assert torch.isfinite(logits.grad).all(), logits.grad
    if kind == "fkl":
        assert d[3].item() > 1e3  # the big (finite) penalty for q_other ~ exp(-2e4) vs tail .5


def test_tail_zero_and_fp16_overflow_buckets():
    logits, ids, lp = _edge_batch()
    b = collapse(logits, ids, lp)
    assert b.logp[0, -1].item() == float("-inf")  # tail exactly 0
    assert b.logp[1, -1].item() == float("-inf")  # known mass > 1: renormalised, tail 0
    assert b.logp[1].exp().sum().item() == pytest.approx(1.0, abs=1e-6)
    assert torch.isfinite(b.logq[3, -1]) and b.logq[3, -1].item() < -1e4  # exp(-2e4), not log(0)
    # rkl floors the zero tail: finite, large, and decreasing in the floor
    r6, r3 = reverse_kl(logits, ids, lp)[0], reverse_kl(logits, ids, lp, tail_floor=1e-3)[0]
    assert torch.isfinite(r6) and r6 > r3
    assert reverse_kl(logits, ids, lp, tail_floor=0.0)[0].item() == float("inf")


@pytest.mark.parametrize("kind", ALL)
def test_finite_gradients_when_k_equals_v(kind):
    logits = torch.tensor([[1e4, -1e4, 0.0], [0.0, 0.1, 0.2]], requires_grad=True)
    ids = torch.tensor([[0, 1, 2], [2, 1, 0]])
    lp = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, -1.0]]), -1).half()
    d = per_position(logits, ids, lp, kind)
    assert torch.isfinite(d).all()
    d.sum().backward()
    assert torch.isfinite(logits.grad).all()
    acc = expected_acceptance(logits.detach(), ids, lp)
    assert torch.equal(acc.lower, acc.upper)


def test_draft_logits_with_minus_inf_outside_topk():
    logits = torch.tensor([[0.0, 1.0, float("-inf"), float("-inf")]], requires_grad=True)
    ids = torch.tensor([[0, 1]])
    lp = torch.tensor([[math.log(0.5), math.log(0.3)]])
    b = collapse(logits, ids, lp)
    assert b.logq[0, -1].item() == float("-inf")
    for kind in ("rkl", "jsd", "tv"):
        logits.grad = None
        per_position(logits, ids, lp, kind).sum().backward()
        assert torch.isfinite(logits.grad).all(), kind


@pytest.mark.parametrize("kind", ALL)
def test_gradient_descent_reduces_loss(kind):
    g = torch.Generator().manual_seed(7)
    p = _rand_dist(g, 4, 20, scale=2.0, dtype=torch.float32)
    ids, lp = _sparse(p, 5)
    lp = lp.half()
    logits = (torch.randn(4, 20, generator=g) * 3).requires_grad_(True)
    opt = torch.optim.Adam([logits], lr=0.1)
    first = None
    for _ in range(60):
        loss = distill_loss(logits, ids, lp, kind=kind)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    last = distill_loss(logits, ids, lp, kind=kind).item()
    assert first > 0.05
    assert last < 0.2 * first, (first, last)
    if kind == "fkl":
        acc = expected_acceptance(logits.detach(), ids, lp)
        assert acc.upper.min().item() > 0.9


def test_fkl_gradient_closed_form():
    """d fkl / d z_v = q_v - p_v in the top-K, q_v (1 - p_tail / q_other) outside."""
    logits, ids, lp = _example()
    logits = logits.clone().requires_grad_(True)
    forward_kl(logits, ids, lp).sum().backward()
    q = torch.softmax(logits.detach(), -1)[0]
    expected = q.clone()
    expected[3] -= 0.5
    expected[1] -= 0.3
    for v in (0, 2, 4):
        expected[v] = q[v] * (1 - 0.2 / 0.4)
    assert torch.allclose(logits.grad[0], expected, atol=1e-12)


@pytest.mark.parametrize("kind", ALL)
def test_gradcheck_float64(kind):
    g = torch.Generator().manual_seed(8)
    p = _rand_dist(g, 3, 6)
    ids, lp = _sparse(p, 2)
    logits = torch.randn(3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: per_position(z, ids, lp, kind, beta=0.4), (logits,))
    assert torch.autograd.gradcheck(lambda z: expected_acceptance(z, ids, lp).upper, (logits,))


def test_no_gradient_to_target():
    logits, ids, lp = _example()
    lp = lp.clone().requires_grad_(True)
    logits.requires_grad_(True)
    forward_kl(logits, ids, lp).sum().backward()
    assert lp.grad is None and logits.grad is not None


# --- weights and the reduced loss --------------------------------------------------------------


def test_position_weights_modes():
    accepted = np.array([True, False, False, True, False])
    draft = np.array([7, 3, -1, 2, 9], dtype=np.int32)
    draft.setflags(write=False)  # as decoded from a record
    assert position_weights(accepted, draft, "all").tolist() == [1.0] * 5
    assert position_weights(accepted, draft, "rejected").tolist() == [0.0, 1.0, 0.0, 0.0, 1.0]
    mix = position_weights(torch.tensor(accepted), torch.tensor(draft), "mix", other_weight=0.25)
    assert mix.dtype == torch.float32 and mix.tolist() == [0.25, 1.0, 0.25, 0.25, 1.0]
    assert position_weights(accepted, draft, "mix").tolist() == pytest.approx([0.2, 1, 0.2, 0.2, 1])
    with pytest.raises(ValueError, match="mode"):
        position_weights(accepted, draft, "some")
    with pytest.raises(ValueError, match="shape"):
        position_weights(accepted[:3], draft, "all")


def test_distill_loss_weighted_mean():
    g = torch.Generator().manual_seed(9)
    p, q = _rand_dist(g, 5, 8), _rand_dist(g, 5, 8)
    ids, lp = _sparse(p, 3)
    w = _t([0.0, 1.0, 0.5, 0.0, 2.0])
    for kind in ALL:
        d = per_position(q.log(), ids, lp, kind, beta=0.3)
        got = distill_loss(q.log(), ids, lp, kind=kind, beta=0.3, weights=w)
        assert got.dim() == 0
        assert got.item() == pytest.approx(((w * d).sum() / w.sum()).item(), abs=1e-12)
        assert distill_loss(q.log(), ids, lp, kind=kind, beta=0.3).item() == pytest.approx(d.mean().item())
    with pytest.raises(ValueError, match="kind"):
        distill_loss(q.log(), ids, lp, kind="kl")
    with pytest.raises(ValueError, match="weights"):
        distill_loss(q.log(), ids, lp, kind="fkl", weights=w[:3])


def test_distill_loss_all_zero_weights_is_zero_without_nan():
    logits, ids, lp = _edge_batch()
    w = torch.zeros(4)
    loss = distill_loss(logits, ids, lp, kind="rkl", weights=w, tail_floor=0.0)  # row 0 is inf
    assert loss.item() == 0.0
    loss.backward()
    assert torch.isfinite(logits.grad).all() and not logits.grad.any()
    # a zero weight masks the infinite positions (rows 0, 1: tail 0, q_other > 0) out of a mean
    logits.grad = None
    loss = distill_loss(logits, ids, lp, kind="rkl", weights=torch.tensor([0.0, 0.0, 1.0, 1.0]), tail_floor=0.0)
    assert torch.isfinite(loss) and loss.item() > 0
    loss.backward()
    assert torch.isfinite(logits.grad).all() and not logits.grad[:2].any() and logits.grad[2:].any()
    # weighted in, they make the loss inf, but the gradient stays NaN-free
    logits.grad = None
    loss = distill_loss(logits, ids, lp, kind="rkl", tail_floor=0.0)
    assert loss.item() == float("inf")
    loss.backward()
    assert not torch.isnan(logits.grad).any()


def test_shape_validation():
    logits, ids, lp = _example()
    with pytest.raises(ValueError, match="shape"):
        forward_kl(logits, ids, lp[:, :1])
    with pytest.raises(ValueError, match="positions"):
        forward_kl(logits.expand(2, 5), ids, lp)
    with pytest.raises(ValueError, match="int32 or int64"):
        forward_kl(logits, ids.float(), lp)
