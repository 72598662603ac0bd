"""How good a candidate draft is, before it serves: α_est on held-out records.

The trainer, the warm start and the benches all judge a candidate the same way: on records
that training never saw (one in `held_out_every`, picked by a hash of the record's id), the
mean per-position acceptance lower bound computed from the records' stored target top-k.
No target forward is needed, so this runs on the trainer's rank 0 in seconds.
"""

from __future__ import annotations

import hashlib

import torch

from train.batching import pack, position_logits
from train.losses import expected_acceptance


def is_held_out(record_id: str, every: int) -> bool:
    """One record in `every`, chosen by a hash of its id (stable across restarts)."""
    return int(hashlib.sha256(record_id.encode()).hexdigest()[:8], 16) % every == 0


@torch.no_grad()
def estimate_alpha(draft: torch.nn.Module, records: list, max_seq_len: int) -> float | None:
    """Mean per-position acceptance lower bound of `draft` on `records`, from the records'
    target top-k alone (no target forward): sum over known tokens of min(p, q)."""
    if not records:
        return None
    draft.eval()
    total, n = 0.0, 0
    for i in range(0, len(records), 8):  # 8 records per forward bounds the [M, V] logits
        batch = pack(records[i:i + 8], max_seq_len)
        acc = expected_acceptance(position_logits(draft, batch), batch.topk_ids, batch.topk_logprobs)
        total += float(acc.lower.sum())
        n += acc.lower.numel()
    return total / n if n else None
