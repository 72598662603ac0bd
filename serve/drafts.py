"""Draft specs for the engine and the benchmark.

- `none`: no draft (autoregressive).
- `self`: the target as its own draft (acceptance 1 under greedy); measures the cost side.
- `truncate:L`: the draft family (infra/draft_model.py) with share_layers: the target's
  first L decoder layers with its embedding, final norm and head, sharing the target's
  tensors (no copy).
- a directory: a draft published by `osd draft init` or the trainer (infra/draft_model.py).
Registry versions come with the registry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infra.draft_spec import DraftSpec, DraftSpecError


def build_draft(spec: str | None, target: Any, *, target_sha256: str | None = None) -> Any | None:
    """The draft `spec` names for `target`. `target_sha256`: the target's identity
    (infra.target.target_identity); a draft directory made for another target is refused."""
    if spec in (None, "", "none"):
        return None
    if spec == "self":
        return target
    if spec.startswith("truncate:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise DraftSpecError(f"bad draft spec {spec!r}: expected truncate:L with an integer L") from None
        total = target.config.num_hidden_layers
        if not 1 <= n <= total:  # checked here: DraftSpec would refuse 0 with a pydantic error
            raise DraftSpecError(f"truncate:{n} needs 1..{total} layers")
        from infra.draft_model import build_draft as build_family

        return build_family(target, DraftSpec(num_layers=n, share_layers=True))
    if Path(spec).expanduser().is_dir():
        from infra.draft_model import load_draft  # a published draft directory (digests checked)

        return load_draft(Path(spec).expanduser(), target, expect_target_sha256=target_sha256)[0]
    raise DraftSpecError(f"unknown draft spec {spec!r}: expected none, self, truncate:L or a draft directory")
