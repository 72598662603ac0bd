"""The offline gate: is a candidate draft better than the current stable one on the same records?

Pure (numpy only; unit tested in milliseconds). The trainer feeds it, for each
held-out record, the sum over the record's positions of each draft's expected acceptance
(train/gate/evaluator.py: `per_record_acceptance`) and the record's number of positions.

Statistic. The expected acceptance per position, a ratio of sums over the records:

    D = sum_i (c_i - s_i) / sum_i n_i

with c_i, s_i the candidate's and stable's sums on record i and n_i its positions, so a
long record weighs by its positions, as it does in `estimate_alpha`.

Pairing. Both drafts are scored on the *same* positions, so the large between-record
variation of acceptance (prompts differ far more than drafts do) cancels in c_i - s_i.
Positions inside a record are correlated; records are (close to) independent. So the record
is the resampling unit: a cluster bootstrap draws records with replacement and recomputes D.
The interval is the percentile interval of those draws, seeded, so the evidence in a
manifest can be recomputed exactly from the per-record differences stored beside it.

Bootstrap method. A seed reproduces an interval only with the generator that drew from it, so
the evidence names its method in `bootstrap` (BOOTSTRAP below). "numpy-v1": one
`np.random.default_rng(seed).integers(0, n, (resamples, n))` matrix of record indices, summed
along its rows. Evidence without the field predates it: a pure-Python loop of
`random.Random(seed).choices(range(n), k=n)` per resample (same statistic and quantiles, other
draws), so its bounds agree with numpy-v1's to within bootstrap noise, not exactly.

Decision. The candidate passes only when the interval's lower bound is above `min_gain`
(0 by default): evidence that it is better, not merely that it is not clearly worse. With
fewer than `min_records` records there is no decision to make, and it fails.

Two intervals. `gate` gives the bootstrap's, valid for one look at a fixed set of records.
`sequential_gate` gives an always-valid one (the canary rule's mSPRT, over records), valid
however often it is looked at as records arrive: the trainer's default (train.gate.method),
which holds a candidate back and looks again at each new held-out record (train/gate/pending.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from infra.common.canary_stats import RatioStats, cs_radius

METHOD = "paired cluster bootstrap over records (percentile interval)"
BOOTSTRAP = "numpy-v1"  # which generator a seed drives; stored with the evidence (see the module doc)


def bootstrap_draws(diffs: Sequence[float], positions: Sequence[int], *, resamples: int = 2000,
                    seed: int = 0) -> np.ndarray:
    """[resamples] the statistic D on record sets drawn with replacement: row r of the index
    matrix idx [resamples, n] is one resample, so D_r = sum diffs[idx[r]] / sum positions[idx[r]]."""
    d = np.asarray(diffs, dtype=np.float64)
    n_pos = np.asarray(positions, dtype=np.float64)
    idx = np.random.default_rng(seed).integers(0, len(d), size=(resamples, len(d)))
    num, den = d[idx].sum(axis=1), n_pos[idx].sum(axis=1)
    # a resample of records without positions has no statistic; 0, as the Python loop had it
    return np.divide(num, den, out=np.zeros_like(num), where=den != 0)


def paired_interval(diffs: Sequence[float], positions: Sequence[int], *, confidence: float = 0.95,
                    resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(D, lower, upper): the per-position difference and its two-sided cluster-bootstrap
    interval, from per-record summed differences `diffs` and per-record `positions`."""
    if len(diffs) != len(positions) or len(diffs) == 0:
        raise ValueError("need one (difference, positions) pair per record, and at least one record")
    total = sum(positions)
    if total <= 0:
        raise ValueError("the records have no positions")
    point = sum(diffs) / total
    tail = (1.0 - confidence) / 2
    # numpy's default quantile is linear between closest ranks, the interpolation the loop used
    lo, hi = np.quantile(bootstrap_draws(diffs, positions, resamples=resamples, seed=seed), [tail, 1.0 - tail])
    return point, float(lo), float(hi)


def _evidence(candidate_sums: Sequence[float], stable_sums: Sequence[float], positions: Sequence[int],
              stable_version: str | None, min_records: int, settings: dict) -> tuple[dict, list[float]]:
    """What both gates' evidence starts with, and the per-record differences; with a `reason`
    already when there is nothing to decide (no stable version, too few records)."""
    ev: dict = {"stable": stable_version, "records": len(positions), "positions": int(sum(positions)),
                **settings, "passed": False}
    if stable_version is None:
        return {**ev, "reason": "no stable version to compare with"}, []
    if not (len(candidate_sums) == len(stable_sums) == len(positions)):
        raise ValueError("candidate, stable and positions must have one entry per record")
    diffs = [c - s for c, s in zip(candidate_sums, stable_sums)]
    total = sum(positions)
    if total > 0:
        ev["candidate_alpha"] = sum(candidate_sums) / total
        ev["stable_alpha"] = sum(stable_sums) / total
    ev["per_record"] = [[round(d, 6), int(n)] for d, n in zip(diffs, positions)]
    if len(positions) < min_records or total <= 0:
        ev["reason"] = f"{len(positions)} held-out records, the gate needs {min_records}"
    return ev, diffs


def gate(candidate_sums: Sequence[float], stable_sums: Sequence[float], positions: Sequence[int], *,
         stable_version: str | None, confidence: float = 0.95, resamples: int = 2000, min_records: int = 20,
         min_gain: float = 0.0, seed: int = 0) -> dict:
    """The gate's evidence for one candidate, as stored in its manifest (`metrics.gate`):
    the paired difference, its interval, `passed`, the reason, and the per-record pairs it
    rests on ([candidate sum - stable sum, positions] per record)."""
    ev, diffs = _evidence(candidate_sums, stable_sums, positions, stable_version, min_records, {
        "confidence": confidence, "resamples": resamples, "seed": seed, "min_gain": min_gain,
        "method": METHOD, "bootstrap": BOOTSTRAP})
    if "reason" in ev:
        return ev
    d, lo, hi = paired_interval(diffs, positions, confidence=confidence, resamples=resamples, seed=seed)
    ev.update(diff=d, lower=lo, upper=hi)
    if lo > min_gain:
        return {**ev, "passed": True,
                "reason": f"better than {stable_version}: {confidence:.0%} interval [{lo:+.4f}, {hi:+.4f}] "
                          f"per position lies above {min_gain:+.4f}"}
    return {**ev, "reason": f"no evidence it beats {stable_version}: {confidence:.0%} interval "
                            f"[{lo:+.4f}, {hi:+.4f}] per position reaches {min_gain:+.4f} or below"}


# The sequential gate: the same paired statistic D, judged by an always-valid confidence
# sequence instead of a one-look bootstrap, so the trainer may look again after every new
# held-out record and let a candidate through as soon as the lower bound clears min_gain.
SEQUENTIAL_METHOD = "paired always-valid confidence sequence over records (mSPRT, delta-method variance)"
SEQ_TAU = 0.05  # the mixture scale: the per-position gain the test is most sensitive to
SEQ_VAR_FLOOR = 1e-5  # per-record unit variance floor: a few identical records are not certainty


def sequential_interval(diffs: Sequence[float], positions: Sequence[int], *, alpha: float = 0.05,
                        tau: float = SEQ_TAU) -> tuple[float, float, float]:
    """(D, lower, upper): the per-position paired difference and its two-sided always-valid
    interval at error rate `alpha`, valid however many times it is looked at as records arrive.
    Records are the clusters, as in the bootstrap; the variance of the ratio D is the delta
    method's, and the radius is the normal-mixture SPRT's (infra/common/canary_stats.py)."""
    if len(diffs) != len(positions) or len(diffs) == 0:
        raise ValueError("need one (difference, positions) pair per record, and at least one record")
    stats = RatioStats()
    for d, n in zip(diffs, positions):
        stats.add(float(d), float(n))
    if stats.sy <= 0:
        raise ValueError("the records have no positions")
    r = cs_radius(stats.var(SEQ_VAR_FLOOR), tau, alpha)
    return stats.ratio, stats.ratio - r, stats.ratio + r


def sequential_gate(candidate_sums: Sequence[float], stable_sums: Sequence[float], positions: Sequence[int], *,
                    stable_version: str | None, alpha: float = 0.05, min_records: int = 8,
                    min_gain: float = 0.0, tau: float = SEQ_TAU) -> dict:
    """The gate's evidence, as `gate` gives it, from the always-valid interval: `passed` when its
    lower bound is above min_gain; `verdict` says which way it stands: "better", "worse" (the upper
    bound is below min_gain: more records will not help), or "undecided" (keep looking)."""
    ev, diffs = _evidence(candidate_sums, stable_sums, positions, stable_version, min_records, {
        "confidence": 1.0 - alpha, "alpha": alpha, "tau": tau, "min_gain": min_gain,
        "method": SEQUENTIAL_METHOD, "verdict": "undecided"})
    if "reason" in ev:
        return ev
    d, lo, hi = sequential_interval(diffs, positions, alpha=alpha, tau=tau)
    ev.update(diff=d, lower=lo, upper=hi)
    span = f"always-valid {1 - alpha:.0%} interval [{lo:+.4f}, {hi:+.4f}] per position over {len(positions)} records"
    if lo > min_gain:
        return {**ev, "passed": True, "verdict": "better",
                "reason": f"better than {stable_version}: {span} lies above {min_gain:+.4f}"}
    if hi < min_gain:
        return {**ev, "verdict": "worse", "reason": f"not better than {stable_version}: {span} lies below {min_gain:+.4f}"}
    return {**ev, "reason": f"no evidence yet it beats {stable_version}: {span} reaches {min_gain:+.4f}"}
