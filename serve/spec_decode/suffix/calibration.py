"""What a suffix chain's empirical probabilities are worth, learned from verification.

An index's probability for a continuation is a count ratio over the few places the context
matched: one earlier occurrence says 1.0. On served traffic tokens were accepted far less
often than their raw probability said, except near 1 (docs/benchmarks.md, "The suffix draft").
Sizing chains on the raw figures verifies rows that almost never pay. So each probability is read through a calibration learned online from
the replica's own verifications: per probability bin, accepted / reached positions, starting
from the raw figure itself as a prior of PRIOR_WEIGHT positions, so a new replica drafts as
before and moves to what its traffic shows.

Pure: no torch, unit-tested in milliseconds.
"""

from __future__ import annotations

from typing import Sequence

BINS = 10
PRIOR_WEIGHT = 8.0
DECAY = 0.999  # per observed position: a shift in traffic moves the figures within a few thousand


class Calibration:
    def __init__(self, bins: int = BINS, prior_weight: float = PRIOR_WEIGHT, decay: float = DECAY):
        if bins < 1 or prior_weight <= 0 or not 0 < decay <= 1:
            raise ValueError("calibration needs bins >= 1, prior_weight > 0 and decay in (0, 1]")
        self.bins, self.prior_weight, self.decay = bins, prior_weight, decay
        self.reached = [0.0] * bins
        self.accepted = [0.0] * bins
        self.predicted = [0.0] * bins  # the raw probabilities of the reached positions, summed

    def _bin(self, p: float) -> int:
        return min(int(p * self.bins), self.bins - 1)

    def __call__(self, p: float) -> float:
        """The acceptance a position proposed at raw probability p has shown: the bin's
        accepted share, shrunk toward p by the prior."""
        b = self._bin(p)
        return (self.prior_weight * p + self.accepted[b]) / (self.prior_weight + self.reached[b])

    def chain(self, probs: Sequence[float]) -> list[float]:
        return [self(p) for p in probs]

    def observe(self, probs: Sequence[float], accepted: int) -> None:
        """A verified chain of raw probabilities `probs`, of which the first `accepted` were
        accepted: positions 0..accepted were reached (the one after the last accepted, if any,
        was rejected)."""
        if not 0 <= accepted <= len(probs):
            raise ValueError(f"accepted {accepted} of a chain of {len(probs)}")
        for i, p in enumerate(probs[:accepted + 1]):
            for stats in (self.reached, self.accepted, self.predicted):
                for j in range(self.bins):
                    stats[j] *= self.decay
            b = self._bin(p)
            self.reached[b] += 1.0
            self.accepted[b] += float(i < accepted)
            self.predicted[b] += p

    def table(self) -> list[dict[str, float]]:
        """Per bin with observations: raw mean, observed acceptance and positions (for /osd/stats)."""
        return [{"raw": self.predicted[b] / self.reached[b], "observed": self.accepted[b] / self.reached[b],
                 "positions": self.reached[b]} for b in range(self.bins) if self.reached[b] >= 1.0]
