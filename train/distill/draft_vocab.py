"""The draft vocabulary from token counts: which V_d target ids the head can propose, and how
many of the target's tokens they cover. Pure numpy, no model.

A position whose target token lies outside the draft vocabulary can never be accepted, so
coverage bounds acceptance. Counts come per source (a domain's answers, or the warm start's
training data); `pooled_frequencies` weights each source by its share, not by its size, so a
large chat set does not crowd out the code and math tokens of smaller ones.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np

STUDY_SIZES = (8192, 16384, 24576)


class VocabError(ValueError):
    """Counts or sizes that cannot make a draft vocabulary (named in the message)."""


def token_counts(seqs: Iterable[Sequence[int] | np.ndarray], vocab: int) -> np.ndarray:
    """[vocab] int64 occurrences of each target id in `seqs`."""
    if vocab < 1:
        raise VocabError(f"vocab must be >= 1, got {vocab}")
    counts = np.zeros(vocab, dtype=np.int64)
    for s in seqs:
        a = np.asarray(s, dtype=np.int64).reshape(-1)
        if a.size and (a.min() < 0 or a.max() >= vocab):
            raise VocabError(f"token ids must lie in [0, {vocab}), got {a.min()}..{a.max()}")
        counts += np.bincount(a, minlength=vocab)
    return counts


def _check(counts: np.ndarray, name: str) -> np.ndarray:
    c = np.asarray(counts)
    if c.ndim != 1 or not c.size:
        raise VocabError(f"{name}: counts must be a non-empty 1-D array, got shape {c.shape}")
    if (c < 0).any():
        raise VocabError(f"{name}: counts must be >= 0")
    return c


def pooled_frequencies(sources: Mapping[str, np.ndarray], weights: Mapping[str, float] | None = None) -> np.ndarray:
    """[vocab] float64: the weighted mean of each source's token frequencies (counts / total);
    weights default to equal. A source with no tokens is refused: it would say nothing."""
    if not sources:
        raise VocabError("no token sources")
    sizes = {name: _check(c, name).size for name, c in sources.items()}
    if len(set(sizes.values())) != 1:
        raise VocabError(f"sources of different vocabulary sizes: {sizes}")
    w = {name: 1.0 for name in sources} if weights is None else dict(weights)
    if set(w) != set(sources) or any(not x >= 0 for x in w.values()) or not sum(w.values()) > 0:
        raise VocabError(f"weights must name every source ({sorted(sources)}) with >= 0 and sum > 0, got {w}")
    out = np.zeros(next(iter(sizes.values())), dtype=np.float64)
    for name, c in sources.items():
        total = float(np.asarray(c).sum())
        if total == 0:
            raise VocabError(f"{name}: no tokens")
        out += w[name] * np.asarray(c, dtype=np.float64) / total
    return out / sum(w.values())


def top_vocab(freq: np.ndarray, v_d: int) -> np.ndarray:
    """The draft vocabulary: the v_d most frequent ids of `freq` [V] (ties to the lower id),
    ascending, int64. v_d above V takes all V."""
    f = _check(freq, "freq")
    if v_d < 2:
        raise VocabError(f"a draft vocabulary needs >= 2 ids, got v_d={v_d}")
    order = np.argsort(-f.astype(np.float64), kind="stable")  # stable: ties keep id order
    return np.sort(order[: min(v_d, f.size)])


def coverage(vocab_ids: np.ndarray, counts: np.ndarray) -> float | None:
    """Fraction of the tokens counted in `counts` [V] whose id is in `vocab_ids`; None if none."""
    c = _check(counts, "counts")
    ids = np.asarray(vocab_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= c.size):
        raise VocabError(f"vocabulary ids must lie in [0, {c.size})")
    total = int(c.sum())
    return float(c[np.unique(ids)].sum()) / total if total else None


def coverage_table(fit: Mapping[str, np.ndarray], evaluate: Mapping[str, np.ndarray],
                   sizes: Sequence[int] = STUDY_SIZES) -> dict[str, dict[str, dict[int, float | None]]]:
    """{vocab choice: {eval domain: {V_d: coverage}}} for two choices from the `fit` counts:
    "balanced" (every fit source weighted alike) and "pooled" (by token count, as one corpus)."""
    if not sizes or any(int(v) < 2 for v in sizes):
        raise VocabError(f"sizes must be >= 2, got {list(sizes)}")
    balanced = pooled_frequencies(fit)  # checks the fit counts
    bad = {d: np.shape(c) for d, c in evaluate.items() if np.shape(c) != balanced.shape}
    if bad:
        raise VocabError(f"eval counts must have the fit counts' shape {balanced.shape}, got {bad}")
    choices = {"balanced": balanced, "pooled": pooled_frequencies({"all": np.sum(list(fit.values()), axis=0)})}
    return {name: {d: {int(v): coverage(top_vocab(freq, int(v)), c) for v in sizes} for d, c in evaluate.items()}
            for name, freq in choices.items()}
