"""What the target computed anyway, kept per verified position at next to no cost.

For every position the target scored *and whose context was committed* (the accepted
drafts plus the one token emitted after them) we keep:
- the target's top-k token ids and log-probabilities (fp16) of its raw distribution
  (temperature 1, no top-k/top-p), which is what distillation needs;
- the emitted token;
- whether the draft proposed that position and the target accepted it;
- the draft's token there (-1 where the draft proposed nothing) and the probability the
  draft gave its own proposal (NaN where none).

Buffers are preallocated for the request's max_new_tokens; each step writes rows with a
handful of tensor ops on the whole block, never Python loops over the vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from infra.records.tokens import topk_logprobs


@dataclass
class Capture:
    """Arrays of one request, row i = the i-th generated token. N rows, K = top_k."""

    topk_ids: np.ndarray  # [N, K] int32
    topk_logprobs: np.ndarray  # [N, K] float16
    tokens: np.ndarray  # [N] int32, the emitted tokens
    accepted: np.ndarray  # [N] bool
    draft_tokens: np.ndarray  # [N] int32, -1 where the draft proposed nothing
    draft_probs: np.ndarray  # [N] float32, NaN where the draft proposed nothing

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class CaptureBuffer:
    def __init__(self, rows: int, top_k: int, device: torch.device):
        self.top_k = top_k
        self.ids = torch.empty(rows, top_k, dtype=torch.int32, device=device)
        self.lps = torch.empty(rows, top_k, dtype=torch.float16, device=device)
        self.n = 0

    def add(self, target_logits: torch.Tensor, topk: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """target_logits: [m, V] fp32 rows for the m committed positions of one step. topk: their
        (ids, log-probs) [>= m, top_k] already computed (a batched step does it for all its
        rows in one call, cheaper a row than one call per request; docs/benchmarks.md)."""
        m = target_logits.shape[0]
        rows = min(m, self.ids.shape[0] - self.n)
        if rows <= 0:
            return
        if topk is None:
            ids, lps = topk_logprobs(target_logits[:rows], self.top_k)
        else:
            ids, lps = topk[0][:rows], topk[1][:rows]
        self.ids[self.n : self.n + rows] = ids
        self.lps[self.n : self.n + rows] = lps
        self.n += rows

    def finish(self, tokens, accepted, draft_tokens, draft_probs) -> Capture:
        n = len(tokens)
        return Capture(
            topk_ids=self.ids[:n].cpu().numpy(),
            topk_logprobs=self.lps[:n].cpu().numpy(),
            tokens=np.asarray(tokens, dtype=np.int32),
            accepted=np.asarray(accepted, dtype=bool),
            draft_tokens=np.asarray(draft_tokens, dtype=np.int32),
            draft_probs=np.asarray(draft_probs, dtype=np.float32),
        )
