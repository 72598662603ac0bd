"""Token-level facts about the target's outputs that serving and training both need.

Serving captures the target's top-k log-probs per verified position and training builds the
same thing for teacher records; both stop at the same EOS. One definition here keeps the
records of the two paths identical, so a draft trained on one is judged fairly on the other.
Pure: torch only, no model library.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely ids [..., k] (int64) of each row of `logits` [..., V] and their
    log-probabilities [..., k] (the logits' dtype) under the raw softmax (temperature 1)."""
    vals, ids = torch.topk(logits, k, dim=-1)
    # log-softmax restricted to the top-k: logit - logsumexp over the full vocab, so the
    # [..., V] log-softmax is never materialised.
    return ids, vals - torch.logsumexp(logits, dim=-1, keepdim=True)


def eos_token_ids(tokenizer: Any, model_eos: int | Sequence[int] | None = None, *,
                  explicit: int | Sequence[int] | None = None) -> list[int]:
    """The stop ids, first set of: `explicit`, the tokenizer's EOS, `model_eos` (the model
    config's `eos_token_id`: an id, a list of ids, or None). [] when none is set.

    The tokenizer wins over the model config: prompts are encoded with it, and its chat
    template ends a turn with its own EOS."""
    eos = explicit
    if eos is None and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        eos = model_eos
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
