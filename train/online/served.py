"""The head's features in the weight format serving runs, for the online head trainer.

The head draft is served the target's layer outputs as the serving runner computes them: for an
int4 target on the CPU, the native int4 forward's (serve/model/native_runner.py). The float32
training copy computes other bits, and a head trained on those is served features it never
saw: its online acceptance fell short of its offline agreement (issue 42). So a head trainer
takes its features, its α estimate's and the gate's from a forward of the served target.

`train` cannot import `serve` (layers point down): the pipeline builds that forward
(pipeline/teacher/served_forward.py) and hands the trainer a factory for it, as it hands the warm
start its teacher. A ServedFactory(cfg) returns the forward, or None where the trainer keeps the
float32 copy's features, and one line that says which and why.

A ServedForward(seqs, layers, logits_from) gives per sequence of L tokens the FeatureRows
(train/teacher/features.py) of its first L-1 tokens, as the warm start's captured features: the
rows serving computes (it never feeds the last token), each with the target's greedy next token
from the served runner's own logits where the caller reads it (GREEDY_ROWS).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import torch

from infra.config import OSDConfig
from train.distill.batching import trim
from train.distill.head import FeatureSet
from train.teacher.features import FeatureRows

# forward(seqs, layers, logits_from): logits_from[i] is sequence i's first row whose greedy
# token (argmax) is wanted, -1 before it; None: every row's.
ServedForward = Callable[..., list[FeatureRows]]
ServedFactory = Callable[[OSDConfig], tuple[ServedForward | None, str]]
# Whose greedy tokens a FeatureSet carries: every row's (a loss over every row), the rows from each
# record's `start` on (the output rows a loss counts, and evaluate() reads), or none (the gate's
# scores read the records' own top-k). Each skipped row saves the target's LM head.
GREEDY_ROWS = ("none", "outputs", "all")  # in the order of what they cover


def greedy_rank(greedy: str) -> int:
    """`greedy`'s place in GREEDY_ROWS (a higher one covers the lower ones' rows); ValueError
    naming the choices for any other name."""
    if greedy not in GREEDY_ROWS:
        raise ValueError(f"greedy must be one of {', '.join(GREEDY_ROWS)}, got {greedy!r}")
    return GREEDY_ROWS.index(greedy)


def served_features(forward: ServedForward, records: Sequence[Any], layers: tuple[int, ...],
                    max_seq_len: int | None, device: torch.device | str = "cpu", greedy: str = "all") -> FeatureSet:
    """records_features (train/distill/head.py) through the served forward: the records cut as
    `trim` cuts them, evaluation from the row predicting the second output token; the greedy
    tokens of the rows `greedy` names (GREEDY_ROWS), -1 elsewhere."""
    greedy_rank(greedy)
    cut = [trim(r, max_seq_len or sys.maxsize) for r in records]
    starts = [max(p - 2, 0) for _, p, _ in cut]
    froms = {"all": [0] * len(cut), "outputs": starts, "none": [len(seq) for seq, _, _ in cut]}[greedy]
    rows = forward([seq.tolist() for seq, _, _ in cut], tuple(layers), froms)
    if len(rows) != len(cut) or not all(torch.equal(r.ids, torch.from_numpy(seq[:-1])) for r, (seq, _, _) in
                                        zip(rows, cut)):
        raise ValueError("the served forward's feature rows are not those of the records' tokens")
    return feature_set(rows, starts, device)


def feature_set(rows: Sequence[FeatureRows], starts: Sequence[int], device: torch.device | str = "cpu") -> FeatureSet:
    """A FeatureSet of sequences' feature rows, evaluation counting each from its `starts` row."""
    fs = FeatureSet()
    for r, start in zip(rows, starts):
        fs.ids.append(r.ids)
        fs.feats.append(r.feats.to(device))
        fs.final.append(r.final.to(device))
        fs.argmax.append(r.argmax)
        fs.start.append(start)
    return fs
