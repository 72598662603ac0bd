"""The propose and verify stages without host syncs, for the CUDA path: the shared pieces
(each draft's `propose_device` drafts with them: serve/spec_decode/protocol.py) and the verify.

The CPU stages (serve/engine/core.py) read each draft token back to the host with int()/float()
as they go; on a GPU each of those waits for the whole queue to drain, which is most of a
launch-bound step. Here draft tokens, their probabilities and the target's argmax stay on
the device, and a step reads the host values it needs (accepted length, the tokens) in one
transfer at the end of verify.

Differences from the CPU stages, chosen because they need a sync per draft token:
- the confidence stop is not applied (the draft-length policy, decided on the host from
  the accepted length the step reads anyway, still is; the cost rule keeps its start-up
  profile there, since stage times arrive as events);
- greedy verification runs on the device; sampling uses the exact CPU rule
  (serve/sampling/verify.py), which reads its accept/reject outcome back.
"""

from __future__ import annotations

from typing import Any

import torch

from serve.sampling.verify import verify_sampling, warp_probs


def choose(logits: torch.Tensor, params: Any, gen: torch.Generator | None):
    """(token index [1], its probability [1], probs [V] or None for greedy), all on device."""
    if params.greedy:
        probs = torch.softmax(logits, dim=-1)
        j = torch.argmax(probs).view(1)
        return j, probs.gather(0, j), None
    probs = warp_probs(logits, params)
    j = torch.multinomial(probs, 1, generator=gen)
    return j, probs.gather(0, j), probs


def so_far(seq: Any, toks: list[torch.Tensor]) -> torch.Tensor | None:
    """This step's drafts so far, on the device, for the request's processors (no host read);
    None without processors, which never read them."""
    if seq.proc is None:
        return None
    return torch.cat(toks) if toks else torch.empty(0, dtype=torch.long, device=seq.device)


def verify(seq: Any, drafts: torch.Tensor, q: torch.Tensor | None,
           logits: torch.Tensor) -> tuple[int, int, list[int]]:
    """(accepted count, next token, the drafts as host ints), with one read from the device."""
    k = drafts.shape[0]
    params = seq.params.sampling
    logits = seq.target_logits(logits, drafts)  # the raw ones still reach commit (capture, logprobs)
    if params.greedy:
        am = torch.argmax(logits, dim=-1)
        n = (drafts == am[:k]).long().cumprod(0).sum().view(1)
        host = torch.cat([n, am, drafts]).tolist()
        n = host[0]
        return n, host[1 + n], host[k + 2:]
    p = warp_probs(logits, params)
    n, nxt = verify_sampling(drafts, q if q is not None else logits.new_zeros(0, logits.shape[-1]), p, seq.gen)
    return n, nxt, drafts.tolist()
