"""What the online trainer does differently per draft family, behind one small interface.

The trainer's loop (read, step, checkpoint, ack, export, gate, publish) is the same for both
families; what differs is how records become a batch, the loss, how exported weights become
a draft again, how a draft is scored and how it is saved:

- `layer` (infra/drafts/layer.py): records are packed as token ids (train/distill/batching.py) and the
  loss compares the draft's logits with the records' stored target top-k (train/distill/objective.py).
- `head` (infra/drafts/head.py): records carry no hidden states, so each step recomputes the
  target's features over prompt + output (one no-grad target forward) and trains the unrolled
  loss over the head's draft vocabulary (train/distill/head.py). The forward is the served
  target's where the trainer was handed one (train/online/served.py: the int4 target's bits, as
  serving feeds the head), else the float32 training copy's. The draft vocabulary (d2t)
  comes from the warm start, so a head trainer starts from a warm-started head, never fresh.

The family is the loaded init draft's (`osd_family`). The gate may compare drafts of two
families (the stable version may be a layer draft, the candidate a head): `per_record`
scores each with its own function, both on the same positions and measure (see
train/distill/head.py: per_record_acceptance_head).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from infra.config import TrainConfig
from infra.drafts.spec import DraftSpec
from train.distill.ds_engine import autocast_context, autocast_dtype

if TYPE_CHECKING:
    from train.online.served import ServedForward

# Records whose target features a head trainer keeps: its replay buffer (256) and its held-out
# records (200) are scored again and again, and the target's forward is most of each step.
FEATURES_KEPT = 480

NO_HEAD_INIT = ("the head family starts from a warm-started head: run `osd draft init --family head` "
                "and pass it as the init draft")


def family_name(draft: Any) -> str:
    return "head" if getattr(draft, "osd_family", None) == "head" else "layer"


def per_record(draft: Any, target: Any, records: list, max_seq_len: int,
               feature_cache: dict | None = None, forward: ServedForward | None = None) -> list[tuple[float, int]]:
    """(summed expected acceptance, positions) per record for a draft of either family.
    `feature_cache`: a dict kept across calls on the same records, so the target's features
    for a head are computed once per set of feature layers, not once per head.
    `forward`: a head's features from the served target (train/online/served.py), not `target`."""
    if family_name(draft) == "head":
        return [(b, n) for b, _, n in per_record_head(draft, target, records, max_seq_len, feature_cache, forward)]
    from train.gate.evaluator import per_record_acceptance

    return per_record_acceptance(draft, records, max_seq_len)


def per_record_head(head: Any, target: Any, records: list, max_seq_len: int, feature_cache: dict | None = None,
                    forward: ServedForward | None = None) -> list[tuple[float, float, int]]:
    """A head's (acceptance bound sum, greedy agreement sum, positions) per record, from one
    unroll (train/distill/head.py per_record_scores_head); feature_cache and forward as per_record's."""
    from train.distill.head import per_record_scores_head

    key = tuple(head.feature_layers)
    feats = feature_cache.get(key) if feature_cache is not None else None
    if feats is None:
        feats = head_features(target, forward, records, key, max_seq_len, greedy="none")  # scores read top-k
        if feature_cache is not None:
            feature_cache[key] = feats
    return per_record_scores_head(head, target, records, max_seq_len, features=feats)


def head_features(target: Any, forward: ServedForward | None, records: list, layers: tuple[int, ...],
                  max_seq_len: int, greedy: str = "all") -> Any:
    """The FeatureSet of `records` at `layers`: from the served forward where there is one, with the
    greedy tokens of the rows `greedy` names (train/online/served.py GREEDY_ROWS), else from the
    float32 `target` (every row's)."""
    from train.distill.head import records_features

    if forward is None:
        return records_features(target, records, layers, max_seq_len)
    from train.online.served import served_features

    return served_features(forward, records, layers, max_seq_len, target.lm_head.weight.device, greedy)


class LayerFamily:
    """Copied target layers on the target's head: packed token batches, top-k distillation."""

    name = "layer"
    autocast = None  # its steps and scores run in float32

    def __init__(self, target: Any, tc: TrainConfig, spec: DraftSpec, draft: Any):
        self.target, self.tc, self.spec = target, tc, spec

    def batch(self, records: list) -> Any:
        from train.distill.batching import pack

        return pack(records, self.tc.max_seq_len)

    def null_batch(self) -> Any:
        """One dummy position with no records: a step that contributes nothing but takes part."""
        from train.distill.batching import Batch

        z = torch.zeros(1, dtype=torch.long)
        return Batch(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long), z, z,
                     torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1), torch.zeros(1, dtype=torch.bool),
                     torch.full((1,), -1, dtype=torch.long), n_records=0, n_tokens=0)

    def loss_fn(self) -> Callable:
        from train.distill.objective import distill_loss_fn

        return distill_loss_fn()

    def rebuild(self, weights: dict[str, torch.Tensor]) -> Any:
        from infra.drafts.layer import draft_with_weights

        return draft_with_weights(self.target, self.spec, weights)

    def score(self, draft: Any, records: list) -> list[tuple[float, int]]:
        """The gate's per-record sums for `draft` (of either family) on `records`."""
        return per_record(draft, self.target, records, self.tc.max_seq_len)

    def save(self, draft: Any, directory: Path, **kw: Any) -> Path:
        from infra.drafts.layer import save_draft

        return save_draft(draft, self.spec, directory, **kw)


class HeadFamily:
    """A head on the target's hidden states: features recomputed per step, the unrolled loss."""

    name = "head"

    def __init__(self, target: Any, tc: TrainConfig, head: Any, forward: ServedForward | None = None):
        self.target, self.tc = target, tc
        self.forward = forward  # the served target's features (train/online/served.py); None: the float32 copy's
        # Kept from the init head before DeepSpeed wraps it: every export is rebuilt on them.
        self.spec, self.d2t = head.spec, head.d2t.detach().cpu().clone()
        self.layers = tuple(head.feature_layers)
        # record id -> (its features as FeatureSet fields, the GREEDY_ROWS index of their greedy tokens)
        self._kept: OrderedDict[str, tuple[tuple, int]] = OrderedDict()
        # The head's steps and gate scores run under bfloat16 autocast where its GEMMs
        # are native, as its warm start's steps do: the step is most of the trainer's time.
        self.autocast = autocast_dtype("auto", tc.device)

    def features(self, records: list, greedy: str = "all") -> Any:
        """The target's features of `records` as one FeatureSet, with the greedy tokens of the rows
        `greedy` names (train/online/served.py GREEDY_ROWS), each record's computed once while it
        stays among the FEATURES_KEPT most recently used (and again where it was kept with fewer
        greedy tokens than asked): replay steps and the gate read the same records many times."""
        from train.distill.head import FeatureSet
        from train.online.served import greedy_rank

        need = greedy_rank(greedy)
        todo = [r for r in records if r.record_id not in self._kept or self._kept[r.record_id][1] < need]
        if todo:
            fresh = head_features(self.target, self.forward, todo, self.layers, self.tc.max_seq_len, greedy)
            # The float32 copy's carry every row's greedy token.
            has = need if self.forward is not None else greedy_rank("all")
            for i, r in enumerate(todo):
                self._kept[r.record_id] = ((fresh.ids[i], fresh.feats[i], fresh.final[i], fresh.argmax[i],
                                            fresh.start[i]), has)
        fs = FeatureSet()
        for r in records:
            self._kept.move_to_end(r.record_id)
            for name, value in zip(("ids", "feats", "final", "argmax", "start"), self._kept[r.record_id][0]):
                getattr(fs, name).append(value)
        while len(self._kept) > max(FEATURES_KEPT, len(records)):
            self._kept.popitem(last=False)
        return fs

    def batch(self, records: list) -> Any:
        """All `records` as one HeadBatch, their features from a no-grad target forward (kept)."""
        from train.distill.head import collate

        fs = self.features(records, self.tc.head_loss_rows)  # "outputs" or "all": the rows its loss counts
        return collate(fs, range(len(fs)))

    def null_batch(self) -> Any:
        from train.distill.head import null_head_batch

        h = self.target.config.hidden_size
        return null_head_batch(len(self.layers) * h, h)

    def loss_fn(self) -> Callable:
        """The online head's loss: train.head_loss on the rows of train.head_loss_rows."""
        from train.distill.head import HEAD_LOSSES, head_loss_fn

        return head_loss_fn(self.target.lm_head.weight.detach(), rows=self.tc.head_loss_rows,
                            **HEAD_LOSSES[self.tc.head_loss])

    def rebuild(self, weights: dict[str, torch.Tensor]) -> Any:
        from infra.drafts.head import head_with_weights

        return head_with_weights(self.target, self.spec, self.d2t, weights)

    def score(self, draft: Any, records: list) -> list[tuple[float, int]]:
        """The gate's per-record sums for `draft` on `records`; a head on this family's feature
        layers reads the kept features, any other draft is scored by its own family."""
        if self._own_head(draft):
            return [(b, n) for b, _, n in self.scores(draft, records)]
        return per_record(draft, self.target, records, self.tc.max_seq_len, forward=self.forward)

    def scores(self, draft: Any, records: list) -> list[tuple[float, float, int]]:
        """A head on this family's feature layers: per record (acceptance bound sum, greedy
        agreement sum, positions) from one unroll on the kept features (the bound is score()'s)."""
        if not self._own_head(draft):
            raise ValueError("greedy agreement is measured for a head on this family's feature layers only")
        from train.distill.head import per_record_scores_head

        fs = self.features(records, "none")  # the scores read the records' own top-k
        with autocast_context(self.autocast, self.tc.device):
            return per_record_scores_head(draft, self.target, records, self.tc.max_seq_len, features=fs)

    def _own_head(self, draft: Any) -> bool:
        return family_name(draft) == "head" and tuple(draft.feature_layers) == self.layers

    def save(self, draft: Any, directory: Path, **kw: Any) -> Path:
        from infra.drafts.head import save_head

        return save_head(draft, directory, **kw)


def family_for(draft: Any, target: Any, tc: TrainConfig, spec: DraftSpec,
               forward: ServedForward | None = None) -> LayerFamily | HeadFamily:
    """The family of the draft a trainer starts from (`spec`: what layer exports are rebuilt to;
    `forward`: a head's features from the served target)."""
    if family_name(draft) == "head":
        return HeadFamily(target, tc, draft, forward)
    return LayerFamily(target, tc, spec, draft)
