"""The loss the DistillEngine steps on: the draft's logits at a packed batch's positions
against the records' target top-k, weighted per position.

The online trainer and the warm start train the same objective; they differ only in which
positions count (the warm start's teacher records have no draft proposals, so it weighs every
position). One closure keeps a change to the loss from reaching one of them and not the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from train.distill.batching import Batch, position_logits
from train.distill.losses import KINDS, WEIGHT_MODES, Kind, WeightMode, distill_loss, position_weights


@dataclass(frozen=True)
class Objective:
    """Which distillation loss (train/distill/losses.py) and which positions count. The platform trains
    the defaults, forward KL at every position; the other losses and weightings are experiments'
    own arguments (they were the settings train.loss, jsd_beta, positions and mix_weight)."""

    loss: Kind = "fkl"
    jsd_beta: float = 0.5  # the JSD's mixture weight (loss jsd)
    positions: WeightMode = "all"  # all, rejected (as OSD) or mix
    mix_weight: float = 0.2  # with positions mix, the weight of the positions a draft got right

    def __post_init__(self) -> None:
        if self.loss not in KINDS or self.positions not in WEIGHT_MODES:
            raise ValueError(f"loss is one of {', '.join(KINDS)} and positions one of {', '.join(WEIGHT_MODES)}, "
                             f"got {self.loss!r} and {self.positions!r}")
        if not 0 < self.jsd_beta < 1 or not 0 <= self.mix_weight <= 1:
            raise ValueError(f"jsd_beta must be in (0, 1) and mix_weight in [0, 1], got {self.jsd_beta} and "
                             f"{self.mix_weight}")


def distill_loss_fn(objective: Objective = Objective(), positions: WeightMode | None = None,
                    ) -> Callable[[torch.nn.Module, Batch], torch.Tensor]:
    """loss_fn(model, batch) -> scalar for `DistillEngine.train_batch`: `objective.loss` over the
    batch's positions, weighted by `positions` (default `objective.positions`, `mix_weight`)."""
    mode = objective.positions if positions is None else positions

    def fn(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        logits = position_logits(model, batch)
        w = position_weights(batch.accepted, batch.draft_tokens, mode, other_weight=objective.mix_weight)
        if batch.n_records == 0:
            w = torch.zeros_like(w)  # null batch: zero loss, zero gradients
        return distill_loss(logits, batch.topk_ids, batch.topk_logprobs, kind=objective.loss,
                            beta=objective.jsd_beta, weights=w)

    return fn


def anchored_loss_fn(base_fn: Callable[[torch.nn.Module, Batch], torch.Tensor], parent: torch.nn.Module,
                     weight: float) -> Callable[[torch.nn.Module, Batch], torch.Tensor]:
    """base_fn + weight x KL(parent || draft) at the batch's trained positions, over the full
    vocabulary, the parent frozen: the draft may learn the new traffic but pays for every
    move away from the draft it started from (`osd bench adapt --variants anchor`)."""

    def fn(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        loss = base_fn(model, batch)
        if batch.n_records == 0 or weight <= 0:
            return loss
        with torch.no_grad():
            p_log = torch.log_softmax(position_logits(parent, batch), dim=-1)
        q_log = torch.log_softmax(position_logits(model, batch), dim=-1)
        kl = (p_log.exp() * (p_log - q_log)).sum(-1).mean()
        return loss + weight * kl

    return fn
