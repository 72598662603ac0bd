"""The draft family's spec and the errors of building or loading a draft.

Light on purpose (pydantic only, no torch): the CLI and the registry name these without
loading a model library. Building and the on-disk format are in infra/drafts/layer.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from infra.config import OSDConfig, TrainConfig
from infra.target import MANIFEST, TargetError


# The draft families a DraftSpec can name: the one list the CLI's choices and path helpers use.
DRAFT_FAMILIES = ("layer", "head")
# serve.draft values that follow the registry's stable/canary aliases: the versions alone, or
# each head version with the replica's one suffix index beside it (their hybrid).
REGISTRY_DRAFTS = ("registry", "registry+suffix")
# What the loop (`osd up`, the chart) serves. The head alone is the draft that pays least on a
# CPU, the suffix draft the most, and a head beside the suffix index never served worse than the
# suffix alone by more than noise (docs: "The suffix draft"); so the loop serves the hybrid, and
# each promoted head improves the steps where the index has no match.
LOOP_DRAFT = "registry+suffix"


def loop_draft(spec: str) -> str:
    """serve.draft in the loop: the registry-following spec the user named, else LOOP_DRAFT."""
    return spec if spec in REGISTRY_DRAFTS else LOOP_DRAFT


class DraftSpecError(ValueError):
    """A DraftSpec does not fit the target (too many layers, bad sizes)."""


class DraftLoadError(TargetError):
    """A saved draft cannot be loaded: incomplete or corrupt directory, or a target it does not fit."""


class DraftSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    num_layers: int = Field(4, ge=1)
    # Which target layers initialise the draft's: the first num_layers, or evenly spaced
    # indices that include the first and the last.
    layer_source: Literal["first", "spaced"] = "first"
    # None = the target's. A different hidden size needs independent_head=True.
    hidden_size: int | None = Field(None, ge=1)
    intermediate_size: int | None = Field(None, ge=1)
    # Train a copy of the final norm and LM head instead of sharing the target's.
    independent_head: bool = False
    # Seed for tensors that cannot be copied from the target (different sizes).
    seed: int = 0
    # Use the target's own layer tensors (shared, frozen) instead of trainable copies: the
    # `truncate:L` draft. Nothing of it is trained, so it is never saved (save_draft refuses).
    share_layers: bool = False
    # "layer": decoder layers copied from the target (above). "head": one decoder layer over
    # the target's own hidden states at `feature_layers` (EAGLE-3 form, infra/drafts/head.py),
    # with its own LM head over the `draft_vocab` most frequent target tokens.
    family: Literal[DRAFT_FAMILIES] = "layer"
    # head only: target layer outputs (0-based) fused by its fc; None = EAGLE-3's low/mid/high.
    feature_layers: tuple[int, ...] | None = None
    draft_vocab: int = Field(8192, ge=2)

    def saved_fields(self) -> dict:
        """The spec as draft.json stores it. A layer draft leaves the head's fields out, so
        readers that predate the head family still parse it."""
        exclude = {"share_layers"} | ({"family", "feature_layers", "draft_vocab"} if self.family == "layer" else set())
        return self.model_dump(mode="json", exclude=exclude)


def draft_spec_from_train(train: TrainConfig) -> DraftSpec:
    """The spec a training run builds its draft to: train.draft_layers, the rest DraftSpec's
    defaults. One place, so the warm start, the online trainer and the benches build the same
    draft."""
    return DraftSpec(num_layers=train.draft_layers)


def short(digest: str | None) -> str:
    """A target digest as messages show it."""
    return f"{digest[:12]}…" if digest else "none"


def target_mismatch(recorded: dict | None, expect_sha256: str | None) -> str | None:
    """Why a draft whose target reference is `recorded` ({"spec", "sha256"}) does not belong to
    the target whose identity (infra.target.target_identity) is `expect_sha256`; None if it does.
    A reference without a digest (drafts saved before the identity was recorded) cannot be told
    apart and passes; loading still checks that the tensors fit."""
    got = (recorded or {}).get("sha256")
    if expect_sha256 is None or got is None or got == expect_sha256:
        return None
    return (f"made for target {(recorded or {}).get('spec')!r} (sha256 {short(got)}), not this one "
            f"(sha256 {short(expect_sha256)})")


def warm_start_path(cfg: OSDConfig, family: str = "layer") -> Path:
    """Where `osd draft init --family {layer,head}` publishes the warm-started draft of `family`
    by default (`osd serve`, `osd up`, the demo and the benches look there)."""
    if family not in DRAFT_FAMILIES:
        raise ValueError(f"unknown draft family {family!r}; known: {', '.join(DRAFT_FAMILIES)}")
    return Path(cfg.state_dir) / "drafts" / ("v1" if family == "layer" else "head-v1")


# The order in which `osd serve` (serve.draft: auto) and `osd up` look for a warm-started draft:
# the head first, because it beat the layer draft on every figure measured on this CPU
# (docs/benchmarks.md, "Head against the layer draft").
PREFERRED_FAMILIES = ("head", "layer")


def warm_started_draft(cfg: OSDConfig) -> Path | None:
    """The complete warm-started draft to serve or publish by default: the head's if
    `osd draft init --family head` finished, else the layer draft's, else None. A directory
    without its manifest (written last) is a warm start still running or cut off, and skipped."""
    for family in PREFERRED_FAMILIES:
        path = warm_start_path(cfg, family)
        if (path / MANIFEST).is_file():
            return path
    return None
