"""A "draft" that proposes nothing and records the target features a head draft reads.

The engine hands a draft the target's features of every row it computes (serve/spec_decode/protocol.py:
`prefilled` gets the prompt's rows 0..P-2, each `commit` the step's committed rows), because a
head draft reads them. Attached to the teacher's requests (pipeline/teacher/engine.py), this
draft keeps them, so the head's warm start trains on features captured during generation with
no second forward pass (train/teacher/features.py).

It asks for the head's layers plus the target's last decoder layer, whose output through the
target's final norm is the LM head's input (`final`), as serve/model/runner.py LlamaRunner computes
its logits. The target's greedy token at a generated row is the token it emitted next (the
engine's own argmax, from its own head), so only the prompt rows' argmax is computed here,
with the model's LM head. Rows are kept in bf16 from the moment they are recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from serve.spec_decode.protocol import Draft, Proposal, StepContext, no_proposal
from train.teacher.features import FeatureRows

ARGMAX_ROWS = 256  # prompt rows per LM-head product: [256, V] logits at a time, not [P, V]


@dataclass
class _Open:
    """A request's rows so far (bf16, on the engine's device)."""

    feats: list[torch.Tensor] = field(default_factory=list)
    final: list[torch.Tensor] = field(default_factory=list)
    prompt_argmax: torch.Tensor | None = None


class FeatureRecorder(Draft):
    """Proposes nothing; records each request's feature rows, handed over by `take` once the
    request finished. Greedy requests only (a generated row's argmax is its emitted token)."""

    family = "feature-recorder"
    uses_kv_cache = False

    def __init__(self, model: Any, layers: tuple[int, ...]):
        cfg = model.config
        self.layers = tuple(layers)
        self.feature_layers = with_last(self.layers, cfg.num_hidden_layers)
        self.norm = model.model.norm.weight
        self.eps = cfg.rms_norm_eps
        self.lm_head = model.lm_head.weight
        self.vocab_size = cfg.vocab_size
        self.max_seq_len = cfg.max_position_embeddings
        self.device = self.lm_head.device
        self._open: dict[int, _Open] = {}  # id(seq) of requests in flight
        self._done: dict[tuple[int, ...], list[FeatureRows]] = {}  # by the finished request's tokens

    # -- the Draft protocol (serve/spec_decode/protocol.py) ------------------------------------

    def prefilled(self, seq: Any, feats: torch.Tensor | None) -> None:
        if not seq.params.sampling.greedy:
            raise ValueError("FeatureRecorder records greedy requests only: it labels a generated row with "
                             "the emitted token, the target's argmax only under greedy decoding")
        rec = self._open[id(seq)] = _Open()
        if feats is not None and feats.shape[0]:
            head, final = self._split(feats)
            rec.feats.append(head.to(torch.bfloat16))
            rec.final.append(final.to(torch.bfloat16))
            rec.prompt_argmax = self._argmax(final)

    def propose(self, seqs: list[Any], ks: list[int], ctx: StepContext) -> list[Proposal]:
        return [no_proposal(seq.device, self.family) for seq in seqs]

    def commit(self, seq: Any, base: int, n: int, drafted: int, feats: torch.Tensor | None) -> None:
        if feats is None:
            raise RuntimeError("the engine gave no features of a committed step to a draft that asked for them")
        head, final = self._split(feats)
        rec = self._open[id(seq)]
        rec.feats.append(head.to(torch.bfloat16))
        rec.final.append(final.to(torch.bfloat16))

    def release(self, seq: Any) -> None:
        """A finished request's rows become FeatureRows (module doc); a failed or cancelled
        request's are dropped."""
        rec = self._open.pop(id(seq), None)
        if rec is None or seq.finish is None or seq.error is not None or seq.cancelled:
            return
        tokens = list(seq.tokens)
        rows = len(tokens) - 1  # the last token was never fed to the target
        prompt_rows = 0 if rec.prompt_argmax is None else rec.prompt_argmax.shape[0]
        feats, final = torch.cat(rec.feats)[:rows], torch.cat(rec.final)[:rows]
        if feats.shape[0] != rows:
            return  # fewer rows than tokens: not a whole answer, take() says so
        argmax = torch.tensor(tokens[prompt_rows + 1:rows + 1], dtype=torch.long)
        if rec.prompt_argmax is not None:
            argmax = torch.cat([rec.prompt_argmax.cpu(), argmax])
        got = FeatureRows(torch.tensor(tokens[:rows], dtype=torch.long), feats.cpu(), final.cpu(), argmax)
        self._done.setdefault(tuple(tokens), []).append(got)

    def teaches_k(self, source: str) -> bool:
        return False

    # -- handing rows over ----------------------------------------------------------

    def take(self, tokens: list[int]) -> FeatureRows:
        """The rows of the finished request whose tokens (prompt + output) were `tokens`."""
        got = self._done.get(tuple(tokens))
        if not got:
            raise KeyError(f"no features recorded for an answer of {len(tokens)} tokens: it was not generated "
                           "through this recorder, or it did not finish")
        rows = got.pop(0)
        if not got:
            del self._done[tuple(tokens)]
        return rows

    # -- helpers ----------------------------------------------------------------------

    def _split(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return split_final(feats, self.feature_layers, self.layers, self.norm, self.eps)

    @torch.no_grad()
    def _argmax(self, final: torch.Tensor) -> torch.Tensor:
        """[T] the target's greedy token after each prompt row, through the model's LM head."""
        return torch.cat([F.linear(final[s:s + ARGMAX_ROWS], self.lm_head).argmax(-1)
                          for s in range(0, final.shape[0], ARGMAX_ROWS)])


def with_last(layers: tuple[int, ...], n_layers: int) -> tuple[int, ...]:
    """The layers to ask a runner for: `layers` and the target's last (whose output, normed, is
    `final`), sorted; ValueError where `layers` are not layers of an `n_layers`-layer target."""
    last = n_layers - 1
    if not layers or not all(0 <= i <= last for i in layers):
        raise ValueError(f"feature layers {layers} are not layers of a {n_layers}-layer target")
    return tuple(sorted(set(layers) | {last}))


@torch.no_grad()  # the norm's weight is a parameter; the features are inference tensors
def split_final(feats: torch.Tensor, asked: tuple[int, ...], layers: tuple[int, ...], norm: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the columns of `layers` [T, nf*h], final hidden [T, h]) of a runner's features [T, na*h]
    of the layers `asked` (with_last), in the runner's dtype (final: LlamaRunner's rms_norm of the
    last layer's output before its head)."""
    h = feats.shape[-1] // len(asked)
    head = torch.cat([feats[:, asked.index(i) * h:(asked.index(i) + 1) * h] for i in layers], dim=-1)
    # asked is sorted, so the target's last layer, the highest, is the last block of columns
    return head, F.rms_norm(feats[:, -h:], (h,), norm, eps)
