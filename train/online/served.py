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

A ServedForward(seqs, layers) gives per sequence of L tokens the FeatureRows
(train/teacher/features.py) of its first L-1 tokens, as the warm start's captured features: the
rows serving computes (it never feeds the last token), each with the target's greedy next token
from the served runner's own logits.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import torch

from infra.config import OSDConfig
from train.distill.batching import trim
from train.distill.head import FeatureSet
from train.teacher.features import FeatureRows

ServedForward = Callable[[Sequence[Sequence[int]], tuple[int, ...]], list[FeatureRows]]
ServedFactory = Callable[[OSDConfig], tuple[ServedForward | None, str]]


def served_features(forward: ServedForward, records: Sequence[Any], layers: tuple[int, ...],
                    max_seq_len: int | None, device: torch.device | str = "cpu") -> FeatureSet:
    """records_features (train/distill/head.py) through the served forward: the records cut as
    `trim` cuts them, evaluation from the row predicting the second output token."""
    cut = [trim(r, max_seq_len or sys.maxsize) for r in records]
    rows = forward([seq.tolist() for seq, _, _ in cut], tuple(layers))
    if len(rows) != len(cut) or not all(torch.equal(r.ids, torch.from_numpy(seq[:-1])) for r, (seq, _, _) in
                                        zip(rows, cut)):
        raise ValueError("the served forward's feature rows are not those of the records' tokens")
    fs = FeatureSet()
    for r, (_, p, _) in zip(rows, cut):
        fs.ids.append(r.ids)
        fs.feats.append(r.feats.to(device))
        fs.final.append(r.final.to(device))
        fs.argmax.append(r.argmax)
        fs.start.append(max(p - 2, 0))
    return fs
