"""Verification of draft tokens against the target: pure functions over tensors.

No model, no framework beyond torch tensors, so every rule here is unit-tested in
milliseconds. Shapes use k = number of draft tokens proposed this step, V = vocab size.

Lossless by construction:
- greedy: the emitted tokens are the target's argmax at every position;
- sampling: standard speculative rejection sampling (Leviathan et al. 2023; Chen et al.
  2023): accept draft token d_i with probability min(1, p_i(d_i) / q_i(d_i)); on the first
  rejection, resample from norm(max(p_i - q_i, 0)); if all k are accepted, sample the bonus
  token from p_{k+1}. The output is then distributed exactly as sampling from p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# Below this temperature decoding is greedy (vLLM's convention, its _SAMPLING_EPS): logits
# divided by a smaller one overflow float32 to inf, and the softmax of that is NaN.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below GREEDY_BELOW) means greedy. top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p, then softmax. logits: [..., V] -> probs [..., V] fp32.

    Applied identically to target and draft logits, so p and q live on the same support
    rules; the target's warped p is the distribution the output must follow.
    """
    x = logits.float()
    if not params.greedy:
        x = x / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the mass of tokens strictly before it already reaches top_p;
        # the most likely token is always kept.
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = before >= params.top_p
        # Said outright, not left to `before` (0 for the first token): a top_p below float32's
        # smallest number rounds to 0 there, and would drop every token (a NaN draw, a 500).
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator))


def verify_greedy(draft_tokens: torch.Tensor, target_argmax: torch.Tensor) -> tuple[int, int]:
    """Accept the longest prefix of drafts equal to the target's argmax.

    draft_tokens: [k] int64; target_argmax: [k+1] int64 (argmax at each scored position).
    Returns (n_accepted, next_token): next_token is the target's token at the first
    mismatch, or its bonus token after position k when all k match.
    """
    k = draft_tokens.shape[0]
    mismatch = (draft_tokens != target_argmax[:k]).nonzero()
    n = int(mismatch[0]) if mismatch.numel() else k
    return n, int(target_argmax[n])


def verify_sampling(
    draft_tokens: torch.Tensor,
    q_probs: torch.Tensor,
    p_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Rejection-sample the drafts.

    draft_tokens: [k] int64, each drawn from the matching row of q_probs [k, V];
    p_probs: [k+1, V] warped target probabilities at the same positions plus one.
    Returns (n_accepted, next_token).
    """
    k = draft_tokens.shape[0]
    if k:
        idx = draft_tokens.view(k, 1)
        p_d = p_probs[:k].gather(1, idx).squeeze(1)
        q_d = q_probs.gather(1, idx).squeeze(1)
        u = torch.rand(k, generator=generator, dtype=p_d.dtype, device=p_d.device)
        # u < p/q written as u*q < p: no division, and q(d) > 0 because d was drawn from q.
        reject = (u * q_d >= p_d).nonzero()
        if reject.numel():
            n = int(reject[0])
            return n, sample(residual(p_probs[n], q_probs[n]), generator)
    return k, sample(p_probs[k], generator)


def verify_positional(draft_tokens: torch.Tensor, p_probs: torch.Tensor, seed: int, start: int) -> tuple[int, int]:
    """Drafts chosen without a draw (a point mass, the suffix draft's): the target's own draw
    at each position, from a generator fixed by (seed, absolute position), accepted while it
    equals the draft. Each emitted token is drawn from the target given its actual prefix, so
    the output is the target's distribution; a draft equal to the draw is accepted with
    probability p(draft), as rejection sampling would accept a point mass; and a seeded
    request gives the same tokens whatever was proposed (what the replica's index held).

    draft_tokens: [k]; p_probs: [k+1, V] warped target probabilities; start: the absolute
    position of row 0. Returns (n_accepted, next_token)."""
    k = draft_tokens.shape[0]
    drafts = draft_tokens.tolist()
    for j in range(k + 1):
        x = positional_draw(p_probs[j], seed, start + j)
        if j == k or x != drafts[j]:
            return j, x
    raise AssertionError("unreachable")


def positional_draw(probs: torch.Tensor, seed: int, position: int) -> int:
    """The target's draw at an absolute position of a seeded request: the same noise whatever
    was proposed there."""
    g = torch.Generator(device=probs.device)
    g.manual_seed((seed * 1_000_003 + position) % (1 << 62))
    return sample(probs, g)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)); falls back to p if the residual has no mass (p == q)."""
    r = torch.clamp(p - q, min=0.0)
    total = r.sum()
    if total <= 0:
        return p
    return r / total
