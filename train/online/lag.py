"""The trainer's bound on lag: it learns from traffic that is seconds old, not minutes.

Records reach the trainer oldest first. When it falls behind (traffic faster than it trains),
a record older than `max_lag_s` when read is skipped, except a fixed share (STALE_KEEP) of
them, picked by a hash of the record id (the same records on every rank and every restart);
skipped records are acked with the next checkpoint and counted. So the trainer spends its
steps on the newest traffic, catches up by reading past what it cannot train on in time, and
still samples the rest. Held-out records are never skipped: the gate needs them. Pure.
"""

from __future__ import annotations

import hashlib

STALE_KEEP = 0.1  # the share of stale records trained on anyway


def is_stale(created_at: float, now: float, max_lag_s: float) -> bool:
    """Older than max_lag_s (0: nothing is ever stale)."""
    return max_lag_s > 0 and now - created_at > max_lag_s


def keep_stale(record_id: str, stale_keep: float) -> bool:
    """Whether a stale record is among the `stale_keep` share that is trained on anyway."""
    h = int.from_bytes(hashlib.blake2b(record_id.encode(), digest_size=8).digest(), "big")
    return h < stale_keep * 2.0**64


def train_on(record_id: str, created_at: float, now: float, max_lag_s: float, stale_keep: float | None = None) -> bool:
    """True to train on the record now; False to skip it (ack it, count it). stale_keep: STALE_KEEP
    where None."""
    return not is_stale(created_at, now, max_lag_s) or keep_stale(record_id, STALE_KEEP if stale_keep is None
                                                                   else stale_keep)
