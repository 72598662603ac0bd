"""How good a candidate draft is, before it serves: α_est on held-out records.

The trainer, the warm start and the benches all judge a candidate the same way: on records
that training never saw (one in `held_out_every`, picked by a hash of the record's id), the
mean per-position acceptance lower bound computed from the records' stored target top-k.
No target forward is needed, so this runs on the trainer's rank 0 in seconds.

The gate (train/gate/compare.py) asks more than α_est: is the candidate better than the current
stable version on the *same* records? `gate_candidate` scores both per record and hands the
paired sums to the gate; the trainer stores the evidence in the candidate's manifest.
"""

from __future__ import annotations

import hashlib
from typing import Container

import torch

from train.distill.batching import pack, position_logits
from train.gate.compare import gate
from train.distill.losses import expected_acceptance


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


@torch.no_grad()
def per_record_acceptance(draft: torch.nn.Module, records: list, max_seq_len: int) -> list[tuple[float, int]]:
    """(sum of the acceptance lower bound over its positions, positions) for each record, in
    order: what the paired gate needs. The sums over all records give `estimate_alpha`."""
    draft.eval()
    out: list[tuple[float, int]] = []
    for i in range(0, len(records), 8):  # as estimate_alpha: 8 records per forward
        batch = pack(records[i:i + 8], max_seq_len)
        lower = expected_acceptance(position_logits(draft, batch), batch.topk_ids, batch.topk_logprobs).lower
        sums = torch.zeros(batch.n_records, dtype=torch.float64).index_add_(0, batch.rows, lower.double())
        counts = torch.bincount(batch.rows, minlength=batch.n_records)
        out += [(float(s), int(c)) for s, c in zip(sums, counts)]
    return out


def gate_records(held_out: list, n: int, trained_prompts: Container[bytes] = frozenset()) -> list:
    """The newest `n` held-out records whose prompt was not trained on in another record (a
    repeated prompt is not unseen): after a domain shift the gate measures the new domain."""
    fresh = [r for r in held_out if r.prompt_ids.tobytes() not in trained_prompts]
    return fresh[-n:] if n > 0 else []


def gate_candidate(candidate: torch.nn.Module, stable: torch.nn.Module | None, stable_version: str | None,
                   records: list, max_seq_len: int, *, stable_scores: list[tuple[float, int]] | None = None,
                   **gate_kw) -> dict:
    """The gate's evidence for `candidate` against `stable` on `records` (see train/gate/compare.py).
    `stable_scores`: stable's per_record_acceptance on these records, if already computed."""
    if stable is None and stable_scores is None:
        return gate([], [], [], stable_version=None, **gate_kw)
    cand = per_record_acceptance(candidate, records, max_seq_len)
    base = stable_scores if stable_scores is not None else per_record_acceptance(stable, records, max_seq_len)
    return gate([c for c, _ in cand], [s for s, _ in base], [n for _, n in cand],
                stable_version=stable_version, **gate_kw)
