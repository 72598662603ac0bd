"""Distillation losses against a sparse (top-K) target distribution. Pure: torch only.

A record stores, for every verified position, the target's top-K token ids and their fp16
log-probabilities (raw distribution, temperature 1). The rest of the target's mass,
``tail = 1 - sum(exp(topk_logprobs))``, lies on tokens whose ids and probabilities we do not
know. The losses here train the draft's full-vocab logits against that partial knowledge.

Shapes (every function also accepts extra leading dims, ``[..., V]`` / ``[..., K]``):
    draft_logits   [N, V]  float (any dtype)   the draft's raw logits, temperature 1
    topk_ids       [N, K]  int32/int64         the target's top-K ids (distinct within a row)
    topk_logprobs  [N, K]  float16/32/64       the target's log-probs of those ids
    weights        [N]     float               per-position weights (``position_weights``)
    result         [N]                         per-position values (float32; float64 if the
                                               logits are float64)

Tail mass: the K+1 bucket partition
-----------------------------------
Both distributions are compared on the same K+1 *buckets*: the K known tokens plus one OTHER
bucket that lumps every token outside the top-K.

* target p:  ``p_k = exp(topk_logprobs)``, ``p_other = tail``. fp16 rounding can make the known
  mass exceed 1 by a hair; then the known part is renormalised and the tail is 0 (never
  negative). If the top-K covers the whole vocabulary (K = V) the tail is 0 by definition
  and the known part is renormalised likewise.
* draft q:   ``q_k = softmax(draft_logits)[topk_ids]``, ``q_other`` = the draft's mass on the
  tokens outside the top-K, computed *directly* as a masked logsumexp over those tokens
  (not as ``1 - sum q_k``), so ``log q_other`` stays exact and finite even when it is
  ``1e-30`` or ``exp(-2e4)``: no cancellation, no ``log(0)``.

Every divergence is then computed exactly on this K+1 partition, in log space and in fp32
(float64 stays float64) whatever the input dtypes. Collapsing two distributions onto a
coarser partition can only shrink an f-divergence (data-processing inequality), so each value
here is a *lower bound* of the same divergence over the full vocabulary, and equals it when
K = V. The alternative — renormalising the target over the top-K and ignoring the tail —
would both overstate the target's confidence and leave the draft free to keep arbitrary
mass on tokens the target deems unlikely; the OTHER bucket charges for that mass.

What the OTHER bucket does to the gradient (forward KL, d/d logits): ``q_v - p_v`` for
v in the top-K, and ``q_v - p_tail * q_v / q_other`` outside it — i.e. exactly the full-vocab
forward-KL gradient against a target whose tail mass is spread over the unknown tokens in
proportion to the draft's own probabilities. The draft is pushed to put ``p_tail`` on the
OTHER tokens in total, but their internal shape is left to itself.

Conventions (p = target, q = draft, sums over the buckets, 0·log 0 = 0):
    forward_kl       KL(p || q) = sum p log(p/q)        mass-covering ("fkl")
    reverse_kl       KL(q || p) = sum q log(q/p)        mode-seeking  ("rkl")
    jsd(beta)        m = beta·p + (1-beta)·q,
                     JSD_beta = beta·KL(p||m) + (1-beta)·KL(q||m)   beta in (0, 1)
                     This is the generalised JSD of GKD (Agarwal et al., 2024), with beta
                     the weight of the *target* in the mixture. It is bounded by the binary
                     entropy H(beta) (log 2 at beta = 0.5, symmetric in p, q there), tends
                     to 0 at both ends, and JSD_beta/beta -> KL(p||q) as beta -> 0,
                     JSD_beta/(1-beta) -> KL(q||p) as beta -> 1. (DistiLLM's *skew* KL,
                     KL(p || a·p + (1-a)·q), is the first of these two terms alone.)
    total_variation  TV = 0.5 · sum |p - q|, in [0, 1]
    expected_acceptance  1 - TV(p, q) over the full vocabulary = sum_v min(p_v, q_v) is the
                     acceptance probability of a draft token under speculative sampling
                     (accept with min(1, p/q)). From the sparse target we get
                     ``lower = sum_k min(p_k, q_k)`` (the tail tokens contribute >= 0) and
                     ``upper = lower + min(p_tail, q_other)`` (sum over the tail of
                     min(p_v, q_v) <= min(p_tail, q_other)); ``upper = 1 - TV_buckets``.
                     Both are exact when K = V.

Reverse KL and a zero tail: if the stored tail is 0 (a confident target, or fp16 rounding)
while the draft keeps mass on OTHER, KL(q || p) on the buckets is infinite. ``reverse_kl``
therefore floors the target's OTHER bucket at ``tail_floor`` (default 1e-6, about the
resolution at which fp16 log-probs fix the tail) — a large but finite penalty that still
drives ``q_other`` to 0. The other divergences use the tail unchanged.

Gradients flow to ``draft_logits`` only (the target side is detached data). All operations
are vectorised over positions and vocabulary; no Python loops. Zero-mass buckets are handled
with the double-``where`` trick, so values and gradients stay finite for a tail of exactly
0, K = V, fp16 log-probs and logits of magnitude 1e4. One full-vocabulary pass (the masked
logsumexp) is made per call; ``collapse`` once and call the ``*_buckets`` functions to
compute several divergences from one pass.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "Acceptance",
    "Buckets",
    "KINDS",
    "WEIGHT_MODES",
    "collapse",
    "distill_loss",
    "expected_acceptance",
    "forward_kl",
    "forward_kl_buckets",
    "jsd",
    "jsd_buckets",
    "per_position",
    "position_weights",
    "reverse_kl",
    "reverse_kl_buckets",
    "total_variation",
    "total_variation_buckets",
]

Kind = Literal["fkl", "rkl", "jsd", "tv"]
WeightMode = Literal["all", "rejected", "mix"]
KINDS: tuple[str, ...] = ("fkl", "rkl", "jsd", "tv")
WEIGHT_MODES: tuple[str, ...] = ("all", "rejected", "mix")

_NEG_INF = float("-inf")


class Buckets(NamedTuple):
    """Both distributions on the K+1 buckets: K known tokens, then OTHER (last)."""

    logp: Tensor  # [..., K+1] target log-probs (detached); logp[..., -1] = log(tail), may be -inf
    logq: Tensor  # [..., K+1] draft log-probs; logq[..., -1] = log(q_other), -inf iff K = V


class Acceptance(NamedTuple):
    """Bounds on the per-position acceptance probability sum_v min(p_v, q_v)."""

    lower: Tensor  # [...] sum over the K known tokens of min(p, q)
    upper: Tensor  # [...] lower + min(p_tail, q_other)  (= 1 - TV on the buckets)


# ---------------------------------------------------------------------------------------
# the K+1 partition


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check(draft_logits: Tensor, topk_ids: Tensor, topk_logprobs: Tensor) -> None:
    if draft_logits.dim() < 1 or not draft_logits.is_floating_point():
        raise ValueError(f"draft_logits must be a float tensor [..., V], got {draft_logits.dtype} "
                         f"{tuple(draft_logits.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not topk_logprobs.is_floating_point():
        raise ValueError(f"topk_logprobs must be floating point, got {topk_logprobs.dtype}")
    if topk_ids.shape != topk_logprobs.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_logprobs "
                         f"{tuple(topk_logprobs.shape)} differ in shape")
    if topk_ids.shape[:-1] != draft_logits.shape[:-1]:
        raise ValueError(f"positions differ: draft_logits {tuple(draft_logits.shape)}, "
                         f"topk_ids {tuple(topk_ids.shape)}")
    k, v = topk_ids.shape[-1], draft_logits.shape[-1]
    if not 1 <= k <= v:
        raise ValueError(f"need 1 <= K <= V, got K={k}, V={v}")


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x <= 0, accurate at both ends (Maechler 2012); -inf at x = 0."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def collapse(draft_logits: Tensor, topk_ids: Tensor, topk_logprobs: Tensor) -> Buckets:
    """Target and draft on the K+1 buckets, in log space (see the module doc)."""
    _check(draft_logits, topk_ids, topk_logprobs)
    dt = _compute_dtype(draft_logits)
    z = draft_logits.to(dt)  # [..., V]
    ids = topk_ids.to(device=z.device, dtype=torch.long)  # [..., K]

    in_topk = torch.zeros(z.shape, dtype=torch.bool, device=z.device).scatter_(-1, ids, True)
    has_other = ~in_topk.all(-1)  # [...] some token lies outside the top-K
    # Rows whose outside tokens all have logit -inf (or that have none) get q_other = 0
    # through the where below, and their logsumexp runs on the unmasked row so that its
    # backward never sees an all -inf row (which would give 0 * NaN).
    draft_other = ((z > _NEG_INF) & ~in_topk).any(-1)  # [...]
    masked = z.masked_fill(in_topk & draft_other.unsqueeze(-1), _NEG_INF)
    lse_other = torch.where(draft_other, torch.logsumexp(masked, -1), _NEG_INF)  # [...]
    z_k = z.gather(-1, ids)  # [..., K]
    lse_all = torch.logaddexp(torch.logsumexp(z_k, -1), lse_other)  # [...]
    logq = torch.cat([z_k - lse_all.unsqueeze(-1), (lse_other - lse_all).unsqueeze(-1)], -1)

    lp = topk_logprobs.detach().to(device=z.device, dtype=dt)  # [..., K]
    lse_p = torch.logsumexp(lp, -1)  # [...] log of the known mass, <= 0 up to rounding
    # Known mass > 1 (fp16 rounding) or no outside tokens: renormalise the known part.
    shift = torch.where(has_other, lse_p.clamp_min(0.0), lse_p)
    log_tail = torch.where(has_other, _log1mexp(lse_p.clamp_max(0.0)), _NEG_INF)
    logp = torch.cat([lp - shift.unsqueeze(-1), log_tail.unsqueeze(-1)], -1)
    return Buckets(logp=logp, logq=logq)


def _kl_terms(loga: Tensor, logb: Tensor) -> Tensor:
    """a * (log a - log b) per bucket: 0 where a == 0, +inf (a constant, no gradient) where
    a > 0 = b; gradient-safe through the double-``where`` trick, so masked-out buckets (and
    masked-out positions downstream) never turn a zero upstream gradient into NaN."""
    pos = loga > _NEG_INF
    fin = pos & (logb > _NEG_INF)
    la = torch.where(pos, loga, 0.0)
    lb = torch.where(fin, logb, 0.0)
    inf_or_zero = torch.where(pos, float("inf"), 0.0).to(la.dtype)
    return torch.where(fin, la.exp() * (la - lb), inf_or_zero)


# ---------------------------------------------------------------------------------------
# divergences on the buckets ([..., K+1] -> [...])


def forward_kl_buckets(b: Buckets) -> Tensor:
    """KL(p || q) on the buckets."""
    return _kl_terms(b.logp, b.logq).sum(-1)


def reverse_kl_buckets(b: Buckets, *, tail_floor: float = 1e-6) -> Tensor:
    """KL(q || p) on the buckets, the target's OTHER bucket floored at ``tail_floor``."""
    if not 0.0 <= tail_floor < 1.0:
        raise ValueError(f"tail_floor must be in [0, 1), got {tail_floor}")
    logp = b.logp
    if tail_floor > 0.0:
        logp = torch.cat([logp[..., :-1], logp[..., -1:].clamp_min(math.log(tail_floor))], -1)
    return _kl_terms(b.logq, logp).sum(-1)


def jsd_buckets(b: Buckets, *, beta: float = 0.5) -> Tensor:
    """beta·KL(p||m) + (1-beta)·KL(q||m), m = beta·p + (1-beta)·q, on the buckets."""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    both = (b.logp > _NEG_INF) | (b.logq > _NEG_INF)  # buckets where m > 0
    la = torch.where(both, b.logp + math.log(beta), 0.0)
    lb = torch.where(both, b.logq + math.log1p(-beta), 0.0)
    logm = torch.logaddexp(la, lb)  # garbage (log 2) where m == 0, but masked by _kl_terms
    return beta * _kl_terms(b.logp, logm).sum(-1) + (1.0 - beta) * _kl_terms(b.logq, logm).sum(-1)


def total_variation_buckets(b: Buckets) -> Tensor:
    """0.5 · sum |p - q| on the buckets."""
    return 0.5 * (b.logp.exp() - b.logq.exp()).abs().sum(-1)


def _acceptance_buckets(b: Buckets) -> Acceptance:
    m = torch.minimum(b.logp.exp(), b.logq.exp())  # [..., K+1]
    lower = m[..., :-1].sum(-1)
    return Acceptance(lower=lower, upper=lower + m[..., -1])


# ---------------------------------------------------------------------------------------
# public per-position functions: (draft_logits [N, V], topk_ids [N, K], topk_logprobs [N, K]) -> [N]


def forward_kl(draft_logits: Tensor, topk_ids: Tensor, topk_logprobs: Tensor) -> Tensor:
    """Per-position KL(target || draft) on the K+1 buckets: [N]."""
    return forward_kl_buckets(collapse(draft_logits, topk_ids, topk_logprobs))


def reverse_kl(draft_logits: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, *,
               tail_floor: float = 1e-6) -> Tensor:
    """Per-position KL(draft || target) on the K+1 buckets: [N] (target tail floored)."""
    return reverse_kl_buckets(collapse(draft_logits, topk_ids, topk_logprobs), tail_floor=tail_floor)


def jsd(draft_logits: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, *, beta: float = 0.5) -> Tensor:
    """Per-position generalised JSD_beta(target, draft) on the K+1 buckets: [N]."""
    return jsd_buckets(collapse(draft_logits, topk_ids, topk_logprobs), beta=beta)


def total_variation(draft_logits: Tensor, topk_ids: Tensor, topk_logprobs: Tensor) -> Tensor:
    """Per-position total variation distance on the K+1 buckets, in [0, 1]: [N]."""
    return total_variation_buckets(collapse(draft_logits, topk_ids, topk_logprobs))


def expected_acceptance(draft_logits: Tensor, topk_ids: Tensor, topk_logprobs: Tensor) -> Acceptance:
    """Bounds [N] on the speculative-sampling acceptance probability sum_v min(p_v, q_v).

    Estimated from the sparse target alone (no target forward): ``lower`` sums min(p, q) over
    the K known tokens, ``upper`` adds min(p_tail, q_other). Differentiable w.r.t. the logits.
    """
    return _acceptance_buckets(collapse(draft_logits, topk_ids, topk_logprobs))


def per_position(draft_logits: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, kind: Kind, *,
                 beta: float = 0.5, tail_floor: float = 1e-6) -> Tensor:
    """The divergence named by ``kind`` ("fkl", "rkl", "jsd", "tv") per position: [N]."""
    if kind not in KINDS:
        raise ValueError(f"unknown loss kind {kind!r}; expected one of {KINDS}")
    b = collapse(draft_logits, topk_ids, topk_logprobs)
    if kind == "fkl":
        return forward_kl_buckets(b)
    if kind == "rkl":
        return reverse_kl_buckets(b, tail_floor=tail_floor)
    if kind == "jsd":
        return jsd_buckets(b, beta=beta)
    return total_variation_buckets(b)


def distill_loss(draft_logits: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, *, kind: Kind,
                 beta: float = 0.5, weights: Tensor | None = None, tail_floor: float = 1e-6) -> Tensor:
    """Weighted mean of ``per_position(kind)``: sum(w · d) / sum(w), a scalar.

    ``weights`` [N] (default: ones) must be >= 0. Positions of weight 0 do not contribute,
    to the value or the gradient, even where their divergence is inf; all-zero weights give
    exactly 0 (still attached to the graph, with zero gradients).
    """
    d = per_position(draft_logits, topk_ids, topk_logprobs, kind, beta=beta, tail_floor=tail_floor)
    if weights is None:
        return d.mean() if d.numel() else d.sum()
    w = weights if isinstance(weights, Tensor) else torch.tensor(weights)
    w = w.to(device=d.device, dtype=d.dtype)
    if w.shape != d.shape:
        raise ValueError(f"weights {tuple(w.shape)} do not match positions {tuple(d.shape)}")
    if bool((w < 0).any()):
        raise ValueError("weights must be >= 0")
    on = w > 0
    num = (w * torch.where(on, d, 0.0)).sum()
    den = w.sum()
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)


# ---------------------------------------------------------------------------------------
# position weights from a record


def position_weights(accepted, draft_tokens, mode: WeightMode = "rejected", *,
                     other_weight: float = 0.2) -> Tensor:
    """Per-position loss weights [N] float32 from a record's ``accepted`` [N] bool and
    ``draft_tokens`` [N] int (-1 where the draft proposed nothing). Numpy or torch inputs.

    A position is *rejected* when the draft proposed a token there and the target rejected
    it: ``draft_tokens >= 0 and not accepted``.

    * ``"all"``: 1 everywhere — distil on every position the target scored.
    * ``"rejected"``: 1 on rejected positions, 0 elsewhere — as OSD (Liu et al., 2023) does:
      train only where the draft was wrong; accepted positions and positions without a
      proposal (the bonus token, or no draft) carry no weight.
    * ``"mix"``: 1 on rejected positions, ``other_weight`` (default 0.2, in [0, 1])
      elsewhere — focus on the mistakes but keep the draft anchored on what it already
      gets right, so it does not drift there.
    """
    if mode not in WEIGHT_MODES:
        raise ValueError(f"unknown weight mode {mode!r}; expected one of {WEIGHT_MODES}")
    acc = accepted if isinstance(accepted, Tensor) else torch.tensor(accepted)
    dtok = draft_tokens if isinstance(draft_tokens, Tensor) else torch.tensor(draft_tokens)
    if acc.shape != dtok.shape:
        raise ValueError(f"accepted {tuple(acc.shape)} and draft_tokens {tuple(dtok.shape)} differ in shape")
    rejected = (dtok.to(acc.device) >= 0) & ~acc.bool()
    if mode == "all":
        return torch.ones(acc.shape, dtype=torch.float32, device=acc.device)
    if mode == "rejected":
        return rejected.to(torch.float32)
    if not 0.0 <= other_weight <= 1.0:
        raise ValueError(f"other_weight must be in [0, 1], got {other_weight}")
    return torch.where(rejected, 1.0, float(other_weight)).to(torch.float32)
