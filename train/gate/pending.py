"""A candidate the trainer holds back until the held-out records say it is better.

With the sequential gate (train.gate.method "sequential"), the trainer freezes a candidate at
each checkpoint and scores it, and the stable version, on the held-out records of the moment;
then on every held-out record that arrives while it waits. The evidence is the always-valid
interval of train/gate/compare.py `sequential_gate`, so looking after every record does not
inflate its error rate. The candidate is published as soon as the lower bound clears
min_gain, dropped as soon as the upper bound falls below it, and replaced (undecided) by the
next checkpoint's candidate otherwise.

Pure: scores come in as numbers, keyed by record id; the trainer computes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from train.gate.compare import sequential_gate

# The records one candidate's evidence rests on at most: the trainer's held-out buffer.
MAX_RECORDS = 200


@dataclass
class Pending:
    """One frozen candidate: `payload` is the trainer's (weights, metrics, lineage); `scores`
    its per-record (summed acceptance, positions), in the order the records came."""

    version: str
    payload: Any
    created: float
    scores: dict[str, tuple[float, int]] = field(default_factory=dict)
    looks: int = 0
    passed_over: set[str] = field(default_factory=set)  # there at the freeze, not chosen: never added later

    def pass_over(self, records: Sequence[Any]) -> None:
        """Records present when the candidate was frozen but not among those chosen for it: a
        later look must not take them up (only records that arrive while it waits are added)."""
        self.passed_over |= {r.record_id for r in records if r.record_id not in self.scores}

    def new_records(self, records: Sequence[Any], usable: Callable[[Any], bool] = lambda r: True) -> list:
        """The records among `records` this candidate has not been scored on nor passed over, that
        `usable` admits, within MAX_RECORDS in all (the newest kept)."""
        fresh = [r for r in records if r.record_id not in self.scores and r.record_id not in self.passed_over
                 and usable(r)]
        room = MAX_RECORDS - len(self.scores)
        return fresh[-room:] if room > 0 else []

    def add(self, records: Sequence[Any], scores: Sequence[tuple[float, int]]) -> None:
        if len(records) != len(scores):
            raise ValueError("one score per record")
        for r, s in zip(records, scores):
            self.scores[r.record_id] = (float(s[0]), int(s[1]))

    def evidence(self, stable_version: str | None, stable_scores: dict[str, tuple[float, int]],
                 **gate_kw: Any) -> dict:
        """The sequential gate's evidence against `stable_version` on every record both were
        scored on (a record the stable has no score for is left out, not guessed)."""
        self.looks += 1
        ids = [i for i in self.scores if i in stable_scores]
        ev = sequential_gate([self.scores[i][0] for i in ids], [stable_scores[i][0] for i in ids],
                             [self.scores[i][1] for i in ids], stable_version=stable_version, **gate_kw)
        ev["looks"] = self.looks
        return ev
