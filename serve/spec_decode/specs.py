"""Draft specs for the engine and the benchmark.

- `none`: no draft (autoregressive).
- `self`: the target as its own draft (acceptance 1 under greedy); measures the cost side.
- `truncate:L`: the draft family (infra/drafts/layer.py) with share_layers: the target's
  first L decoder layers with its embedding, final norm and head, sharing the target's
  tensors (no copy).
- `head:untrained`: a head draft (infra/drafts/head.py) as built before training, its
  vocabulary the first 8192 token ids: its acceptance means nothing, its cost per draft
  token is a trained head's (`osd bench engine` on a GPU with no trained head at hand).
- `suffix`: suffix decoding over each request's own context and the replica's recent outputs
  (serve/spec_decode/suffix/draft.py): no weights, learned from every served token at once.
- `H+suffix` (H a head: a head draft directory or head:untrained; `head+suffix` names the
  warm-started head, resolved by `resolve_auto`): the head and the suffix draft, the suffix
  chain taken at each step where it expects at least as many accepted tokens as the head.
- a directory: a draft published by `osd draft init` or the trainer (infra/drafts/layer.py).
- `auto` (serve.draft's default): resolved once by `resolve_auto` before anything is built:
  `suffix`, chosen by measurement (AUTO_DRAFT).
- `registry`: the registry's stable and canary versions, hot-swapped as their aliases move
  (serve/api/hot_swap.py); `registry+suffix`: each head version beside the replica's one suffix
  index, which every swap keeps (the loop's draft, infra/drafts/spec.py LOOP_DRAFT).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infra.config import OSDConfig
from infra.drafts.spec import DraftSpec, DraftSpecError, warm_start_path, warm_started_draft

AUTO = "auto"
# What `auto` serves, chosen by measurement (docs/benchmarks.md, "The suffix draft"): suffix
# decoding needs no training, so a new machine serves at once, and it beat own AR on held-out
# ShareGPT where truncate:4, the default before it, lost. It also tied or beat the
# warm-started head beside it, alone and under load, so a warm-started head is served when
# named (head+suffix), and in the loop.
AUTO_DRAFT = "suffix"


def build_draft(spec: str | None, target: Any, *, target_sha256: str | None = None,
                suffix: Any = None) -> Any | None:
    """The draft `spec` names for `target`. `target_sha256`: the target's identity
    (infra.target.target_identity); a draft directory made for another target is refused.
    `suffix`: the suffix draft's settings (serve.suffix; default its defaults)."""
    if spec in (None, "", "none"):
        return None
    if spec == "suffix" or spec.endswith("+suffix"):
        from infra.config import SuffixConfig
        from serve.spec_decode.suffix.draft import SuffixDraft, WithSuffix

        chains = SuffixDraft.from_config(suffix or SuffixConfig(), target.config.vocab_size)
        if spec == "suffix":
            return chains
        model = build_draft(spec.removesuffix("+suffix"), target, target_sha256=target_sha256)
        if model is None or not hasattr(model, "d2t"):
            raise DraftSpecError(f"{spec!r}: the draft before +suffix must be a head (a head draft directory, "
                                 f"head:untrained, or head for the warm-started one)")
        return WithSuffix(model, chains)
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
        from infra.drafts.layer import build_draft as build_family

        return build_family(target, DraftSpec(num_layers=n, share_layers=True))
    if spec == "head:untrained":
        import torch

        from infra.drafts.head import build_head

        v_d = min(8192, target.config.vocab_size)
        d2t = torch.arange(v_d, device=target.lm_head.weight.device)
        return build_head(target, DraftSpec(family="head"), d2t)
    if Path(spec).expanduser().is_dir():
        from infra.drafts.layer import load_draft  # a published draft directory (digests checked)

        return load_draft(Path(spec).expanduser(), target, expect_target_sha256=target_sha256)[0]
    raise DraftSpecError(f"unknown draft spec {spec!r}: expected none, self, truncate:L, suffix or a draft directory")


def resolve_auto(cfg: OSDConfig) -> tuple[str, str]:
    """(the spec serve.draft stands for, a line saying why): `auto` is the suffix draft (its
    measurements above), `head+suffix` the warm-started head with it; any other spec is
    returned as it is."""
    if cfg.serve.draft == "head+suffix":
        head = warm_start_path(cfg, "head")
        if not (head / "draft.json").is_file():
            raise DraftSpecError(f"serve.draft head+suffix needs the warm-started head in {head}: run "
                                 f"`osd draft init --family head` first")
        return f"{head}+suffix", f"serve.draft head+suffix: the warm-started head {head} with the suffix draft"
    if cfg.serve.draft != AUTO:
        return cfg.serve.draft, f"serve.draft {cfg.serve.draft}"
    found = warm_started_draft(cfg)
    named = "head+suffix" if found == warm_start_path(cfg, "head") else str(found)
    also = (f"; the warm-started draft {found} is served with --draft {named}" if found is not None
            else "; `osd draft init --family head` makes the head that `--draft head+suffix` adds")
    return AUTO_DRAFT, f"serve.draft auto: {AUTO_DRAFT} (suffix decoding over served outputs, no training){also}"
