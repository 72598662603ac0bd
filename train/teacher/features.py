"""Target features captured while the teacher's answers were generated, kept beside each shard.

The head draft trains on the target's layer outputs and final hidden state
(train/distill/head.py FeatureSet). The serving engine computes them anyway while it generates
the teacher's answers (pipeline/teacher/feature_recorder.py records them), so the warm start needs no
second forward over those answers. They are also the features serving feeds the head (the
engine's weight format, not the fp32 training copy's).

Rows. An answer of L tokens (prompt + output) has rows 0..L-2 only: the target never reads the
last output token (it would be the next step's input). So an answer's rows cover its first L-1
tokens, and training loses one row per answer: the one whose target is the position after the
answer's last token (after its EOS, or its length cut), the least useful row it has.

On disk (train/teacher/store.py): one file per shard, `shard-<name>.features.pt` (torch.save,
read back with weights_only): each field concatenated over the shard's answers (bf16 features,
int32 tokens) with their lengths, the layers, and the shard's content sha256, so a features
file is used only with the very answers it was captured with.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from infra.records.schema import Record

FEATURES_FORMAT = 1
FEATURES_SUFFIX = ".features.pt"


class FeaturesCorrupt(RuntimeError):
    """A features file is unreadable or does not belong to its shard's answers."""


@dataclass
class FeatureRows:
    """One answer's rows (T = L-1 for L tokens of prompt + output), the fields of a FeatureSet
    sequence (train/distill/head.py)."""

    ids: torch.Tensor  # [T] int64: prompt + output without its last token
    feats: torch.Tensor  # [T, nf*h] bf16: the head's layers' outputs, concatenated in layer order
    final: torch.Tensor  # [T, h] bf16: the target's final norm of its last layer's output
    argmax: torch.Tensor  # [T] int64: the target's greedy next token at each row

    def __post_init__(self) -> None:
        t = self.ids.shape[0]
        if self.feats.shape[0] != t or self.final.shape[0] != t or self.argmax.shape[0] != t:
            raise ValueError(f"feature rows disagree: ids {t}, feats {self.feats.shape[0]}, "
                             f"final {self.final.shape[0]}, argmax {self.argmax.shape[0]}")

    def matches(self, record: Record) -> bool:
        """Whether these are the rows of `record`'s tokens (all but its last)."""
        want = np.concatenate([record.prompt_ids, record.output_ids]).astype(np.int64)[:-1]
        return want.shape[0] == self.ids.shape[0] and bool((torch.from_numpy(want) == self.ids).all())

    def cut(self, tokens: int) -> "FeatureRows":
        """The rows of an answer cut to `tokens` tokens (an answer cut after its first EOS)."""
        t = tokens - 1
        if t > self.ids.shape[0]:
            raise ValueError(f"{t} rows asked of an answer with {self.ids.shape[0]}")
        return FeatureRows(self.ids[:t], self.feats[:t], self.final[:t], self.argmax[:t])

    def digest(self) -> str:
        h = hashlib.sha256()
        for t in (self.ids, self.feats, self.final, self.argmax):
            h.update(str(tuple(t.shape)).encode() + t.contiguous().view(torch.uint8).numpy().tobytes() + b"\0")
        return h.hexdigest()


@dataclass
class Answers:
    """A chunk's answers as a teacher generator made them: its records, and where the generator
    captured them, each record's feature rows (train/teacher/store.py writes both)."""

    records: list[Record]
    features: list[FeatureRows] | None = None
    layers: tuple[int, ...] = ()  # the target layers of FeatureRows.feats


def features_payload(rows: Sequence[FeatureRows], *, key: str, shard_digest: str, prompts: list,
                     layers: tuple[int, ...]) -> dict[str, Any]:
    """What a shard's features file holds (module doc): a few large tensors, not one per answer."""
    return {"format": FEATURES_FORMAT, "key": key, "shard_digest": shard_digest, "prompts": prompts,
            "layers": list(layers), "lengths": torch.tensor([r.ids.shape[0] for r in rows], dtype=torch.int64),
            "ids": _cat([r.ids.to(torch.int32) for r in rows], torch.int32),
            "argmax": _cat([r.argmax.to(torch.int32) for r in rows], torch.int32),
            "feats": _cat([r.feats.to(torch.bfloat16) for r in rows], torch.bfloat16),
            "final": _cat([r.final.to(torch.bfloat16) for r in rows], torch.bfloat16)}


def rows_of_payload(obj: Any, *, key: str, shard_digest: str,
                    prompts: list) -> tuple[tuple[int, ...], list[FeatureRows]]:
    """(layers, rows per answer) of a loaded features file; FeaturesCorrupt unless it is the
    file of this shard's content."""
    if not isinstance(obj, dict) or obj.get("format") != FEATURES_FORMAT:
        raise FeaturesCorrupt(f"not a features file of format {FEATURES_FORMAT}")
    if obj.get("key") != key or obj.get("shard_digest") != shard_digest or obj.get("prompts") != prompts:
        raise FeaturesCorrupt("captured with other answers than its shard's")
    try:
        lengths = [int(n) for n in obj["lengths"]]
        bounds = np.cumsum([0] + lengths).tolist()
        fields = [obj[name] for name in ("ids", "feats", "final", "argmax")]
        if len(lengths) != len(prompts) or any(f.shape[0] != bounds[-1] for f in fields):
            raise FeaturesCorrupt("row counts do not add up")
        rows = [FeatureRows(fields[0][a:b].long(), fields[1][a:b], fields[2][a:b], fields[3][a:b].long())
                for a, b in zip(bounds, bounds[1:])]
        return tuple(int(i) for i in obj["layers"]), rows
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise FeaturesCorrupt(f"fields do not decode: {e}") from None


class TeacherDataError(ValueError):
    """Teacher generation cannot run on these inputs (a prompt over the context, no pad id), or
    a generator's output is not what it claims. Here, below train/teacher/data.py (which
    re-exports it), so the features' checks raise it without an import cycle."""


def check_rows(records: Sequence[Record], rows: Sequence[FeatureRows]) -> None:
    """A generator's features must be its records' (else a bug upstream: refuse to store them)."""
    if len(rows) != len(records) or not all(f.matches(r) for f, r in zip(rows, records)):
        raise TeacherDataError("the generator's captured features are not those of its answers' tokens")


def features_path(shard: Path) -> Path:
    """The features file beside a shard `shard-<name>.arrow`."""
    return shard.with_name(shard.name.removesuffix(".arrow") + FEATURES_SUFFIX)


def load_payload(path: Path) -> Any:
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # torch.load raises many types for a torn or foreign file
        raise FeaturesCorrupt(f"unreadable ({type(e).__name__}: {e})") from None


def _cat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype)
