"""The draft family the distillation trainer learns, and its on-disk format.

A draft is a small Llama built out of the target:

- its decoder layers are trainable COPIES of `num_layers` target layers, chosen by
  `layer_source`: "first" (layers 0..L-1) or "spaced" (evenly spaced, first and last
  included); with `share_layers` they are the target's own layer tensors instead (shared,
  frozen; the `truncate:L` draft of serve/spec_decode/specs.py), and such a draft is never saved;
- its token embedding, final norm and LM head are the target's own tensors, SHARED (same
  storage, no copy) and FROZEN. With `independent_head` the norm and head are trainable
  copies instead (the embedding stays shared).
- `hidden_size` / `intermediate_size` other than the target's: tensors whose shapes then
  differ from the target's are randomly initialised (seeded by `seed`); a different hidden
  size leaves nothing shareable, so it needs `independent_head=True` and the embedding is
  trained too.

On disk (one directory, written atomically: a temp dir beside it, renamed at the end):

    config.json         the draft's Hugging Face config
    draft.safetensors   the trainable tensors only (never the shared ones), safetensors
    draft.json          {"format", "kind", "spec", "target_ref" ({"spec", "sha256"}: the
                         target's identity, infra.target.target_identity), "layer_indices",
                         "shared_tensors": {name: {"shape", "dtype"}}, "trainable_tensors",
                         "lineage", "metrics", "created_at"}
    osd-manifest.json   sha256 + size of every file above; written last

`load_draft` verifies the manifest before reading anything, rebuilds the model from
config.json, loads draft.safetensors (safetensors only, no pickle) and attaches the given
target's tensors for the shared names, refusing a target whose shapes do not fit, or whose
identity is not the one draft.json records (when the caller gives it).
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import torch

from infra.drafts.spec import DraftLoadError, DraftSpec, DraftSpecError, target_mismatch  # noqa: F401 (re-exported)
from infra.target import LEAN_FAMILIES, MANIFEST, TargetError, identify_target, target_identity, verify_manifest

# The directory's files and their atomic write, shared with the head (re-exported here).
from infra.drafts.files import (  # noqa: F401 (re-exported)
    CONFIG_FILE,
    DRAFT_FORMAT,
    INFO_FILE,
    WEIGHTS_FILE,
    forget_source_path,
    write_draft_dir,
)

EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
HEAD = "lm_head.weight"
# Set on every draft module built or loaded here: the state-dict names that are the target's.
SHARED_ATTR = "osd_shared_names"
# ... and the target layer each decoder layer was copied from.
INDICES_ATTR = "osd_layer_indices"


# ---------------------------------------------------------------- building

def layer_indices(spec: DraftSpec, target_layers: int) -> list[int]:
    """The target layer index that initialises each draft layer."""
    n = spec.num_layers
    if n > target_layers:
        raise DraftSpecError(f"draft wants {n} layers, the target has only {target_layers}")
    if spec.layer_source == "first" or n == 1:
        return list(range(n))
    # Evenly spaced over [0, L-1], both ends included; step >= 1 so the indices are distinct.
    return [int(i * (target_layers - 1) / (n - 1) + 0.5) for i in range(n)]


def shared_names(draft: Any) -> tuple[str, ...]:
    """State-dict names of `draft` that are the target's tensors (set by build/load)."""
    names = getattr(draft, SHARED_ATTR, None)
    if names is None:
        raise DraftSpecError("this model was not built by infra.drafts.layer (no shared-tensor list)")
    return tuple(names)


def _draft_config(target_config: Any, spec: DraftSpec, indices: list[int]) -> Any:
    cfg = copy.deepcopy(target_config)
    cfg.num_hidden_layers = spec.num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[i] for i in indices]
    if spec.hidden_size is not None and spec.hidden_size != target_config.hidden_size:
        if spec.hidden_size % cfg.num_attention_heads:
            raise DraftSpecError(
                f"hidden_size {spec.hidden_size} is not a multiple of num_attention_heads "
                f"{cfg.num_attention_heads}"
            )
        cfg.hidden_size = spec.hidden_size
        cfg.head_dim = spec.hidden_size // cfg.num_attention_heads
    if spec.intermediate_size is not None:
        cfg.intermediate_size = spec.intermediate_size
    if spec.independent_head:
        cfg.tie_word_embeddings = False
    return forget_source_path(cfg)


def _fresh_model(cfg: Any, seed: int, dtype: torch.dtype, device: torch.device) -> Any:
    """A randomly initialised model of `cfg`, the same for the same seed."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.to(device=device, dtype=dtype)


def _materialise_buffers(draft: Any, cfg: Any, device: torch.device) -> None:
    """Non-persistent buffers (RoPE inv_freq) are not in any state dict: after building on
    the meta device, recompute them for real from the draft's own config."""
    inner = draft.model
    if any(b.is_meta for b in inner.rotary_emb.buffers()):
        inner.rotary_emb = type(inner.rotary_emb)(config=cfg).to(device)
    left = [name for name, b in draft.named_buffers() if b.is_meta]
    if left:
        raise DraftSpecError(f"buffers left on the meta device: {left}")


def _assemble(cfg: Any, tensors: dict[str, torch.Tensor], shared: set[str], dtype: torch.dtype,
              device: torch.device, generation_config: Any = None) -> Any:
    """Build the module on meta, assign `tensors` (no copies), freeze the shared ones."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        draft = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    expected = set(draft.state_dict().keys())
    missing, unexpected = expected - tensors.keys(), tensors.keys() - expected
    if missing or unexpected:
        raise DraftSpecError(f"draft tensors do not match its config: missing {sorted(missing)}, "
                             f"unexpected {sorted(unexpected)}")
    # detach(): a new Parameter over the same storage, so the target's own Parameter objects
    # (and their requires_grad) are never touched.
    draft.load_state_dict({k: v.detach() for k, v in tensors.items()}, assign=True, strict=True)
    if cfg.tie_word_embeddings:
        draft.tie_weights()
    _materialise_buffers(draft, cfg, device)
    for name, p in draft.named_parameters(remove_duplicate=False):
        p.requires_grad_(name not in shared)
    setattr(draft, SHARED_ATTR, tuple(sorted(shared)))
    if generation_config is not None:
        draft.generation_config = copy.deepcopy(generation_config)
    return draft.eval()


def _check_spec(spec: DraftSpec, tcfg: Any) -> None:
    if getattr(tcfg, "model_type", None) not in LEAN_FAMILIES:
        raise DraftSpecError(f"layer drafts need a target of {', '.join(LEAN_FAMILIES)}; "
                             f"the target is {getattr(tcfg, 'model_type', None)!r}")
    new_hidden = spec.hidden_size is not None and spec.hidden_size != tcfg.hidden_size
    if new_hidden and not spec.independent_head:
        raise DraftSpecError(
            f"hidden_size {spec.hidden_size} differs from the target's {tcfg.hidden_size}: the target's "
            f"head cannot be shared, set independent_head=True"
        )
    new_ffn = spec.intermediate_size is not None and spec.intermediate_size != tcfg.intermediate_size
    if spec.share_layers and (new_hidden or new_ffn):
        raise DraftSpecError("share_layers uses the target's own layers, so hidden_size and intermediate_size "
                             "must be the target's")


def build_draft(target_model: Any, spec: DraftSpec | None = None) -> Any:
    """A LlamaForCausalLM draft of `target_model` per `spec` (see the module doc).

    Decoder layers are trainable copies (the target's own, frozen, with share_layers);
    embedding, final norm and head share the target's storage and are frozen (norm and head
    are trainable copies with independent_head)."""
    spec = spec or DraftSpec()
    tcfg = target_model.config
    _check_spec(spec, tcfg)
    indices = layer_indices(spec, tcfg.num_hidden_layers)
    cfg = _draft_config(tcfg, spec, indices)
    dtype, device = target_model.dtype, next(target_model.parameters()).device
    tsd = target_model.state_dict()
    fresh: dict[str, torch.Tensor] | None = None

    def fresh_tensor(name: str) -> torch.Tensor:
        nonlocal fresh
        if fresh is None:
            fresh = _fresh_model(cfg, spec.seed, dtype, device).state_dict()
        return fresh[name]

    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    shapes = {k: v.shape for k, v in skeleton.state_dict().items()}
    del skeleton

    tensors: dict[str, torch.Tensor] = {}
    shared: set[str] = set()
    for name, shape in shapes.items():
        if name.startswith("model.layers."):
            _, _, j, rest = name.split(".", 3)
            src = tsd.get(f"model.layers.{indices[int(j)]}.{rest}")
            if spec.share_layers:  # _check_spec made the shapes the target's
                tensors[name] = src
                shared.add(name)
                continue
            tensors[name] = src.clone() if src is not None and src.shape == shape else fresh_tensor(name).clone()
            continue
        src = tsd.get(name)
        if src is None or src.shape != shape:
            tensors[name] = fresh_tensor(name).clone()
        elif name == EMBED or (name in (NORM, HEAD) and not spec.independent_head):
            tensors[name] = src  # the target's storage
            shared.add(name)
        else:
            tensors[name] = src.clone()
    if cfg.tie_word_embeddings and HEAD in tensors:
        tensors[HEAD] = tensors[EMBED]
        if EMBED in shared:
            shared.add(HEAD)
    draft = _assemble(cfg, tensors, shared, dtype, device, target_model.generation_config)
    setattr(draft, INDICES_ATTR, tuple(indices))
    return draft


def draft_with_weights(target_model: Any, spec: DraftSpec, weights: dict[str, torch.Tensor]) -> Any:
    """A fresh draft of `spec` whose trainable tensors are `weights` (as exported by the trainer)."""
    draft = build_draft(target_model, spec)
    params = dict(draft.named_parameters())
    missing = set(weights) - set(params)
    if missing:
        raise DraftSpecError(f"exported weights do not fit the draft: {sorted(missing)[:3]}")
    with torch.no_grad():
        for n, w in weights.items():
            params[n].copy_(w)
    return draft


def trainable_state_dict(draft: Any, spec: DraftSpec | None = None) -> dict[str, torch.Tensor]:
    """The draft's own tensors (everything not shared with the target), detached."""
    shared = set(shared_names(draft))
    out = {k: v for k, v in draft.state_dict().items() if k not in shared}
    if spec is not None and spec.independent_head and HEAD in shared:
        raise DraftSpecError("spec says independent_head but the draft shares the target's head")
    return out


# ---------------------------------------------------------------- target reference

def target_ref(loaded: Any) -> dict[str, Any]:
    """{"spec", "sha256"} of a infra.target.LoadedModel; sha256 is its identity
    (infra.target.target_identity), never None."""
    return {"spec": loaded.spec, "sha256": target_identity(loaded)}


def target_ref_of(model_cfg: Any, model: Any) -> dict[str, Any]:
    """target_ref of the configured target (infra.config.ModelConfig), given as its loaded model."""
    return {"spec": model_cfg.target, "sha256": identify_target(model_cfg.target, model_cfg, model)}


# ---------------------------------------------------------------- save / load

def save_draft(draft: Any, spec: DraftSpec, directory: str | Path, *, target_ref: dict[str, Any],
               lineage: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None,
               overwrite: bool = False) -> Path:
    """Write the draft into `directory` atomically; returns the directory.

    An existing directory is refused unless overwrite=True (then it is replaced whole)."""
    directory = Path(directory)
    if spec.share_layers or any(n.startswith("model.layers.") for n in shared_names(draft)):
        # Its layers are the target's: saving the trainable tensors would write nothing of it,
        # and loading that onto any target of the same shape would give that target's layers.
        raise DraftSpecError("a share_layers draft is the target's own layers and is not saved; "
                             "serve it as truncate:L")
    if directory.exists() and not overwrite:
        raise FileExistsError(f"{directory} exists; pass overwrite=True to replace it")
    directory.parent.mkdir(parents=True, exist_ok=True)
    shared = shared_names(draft)
    sd = draft.state_dict()
    trainable = {k: v.detach().contiguous().cpu() for k, v in trainable_state_dict(draft, spec).items()}
    info = {
        "format": DRAFT_FORMAT,
        "kind": "osd-draft",
        # share_layers is always False here; left out so readers of older code still parse it.
        "spec": spec.saved_fields(),
        "target_ref": target_ref,
        "layer_indices": list(getattr(draft, INDICES_ATTR, ()) or ()),
        "shared_tensors": {k: {"shape": list(sd[k].shape), "dtype": str(sd[k].dtype).removeprefix("torch.")}
                           for k in shared},
        "trainable_tensors": sorted(trainable),
        "lineage": lineage or {},
        "metrics": metrics or {},
        "created_at": time.time(),
    }
    return write_draft_dir(directory, draft.config, trainable, info)


def _checked_manifest(directory: Path, verified: dict[str, str] | None) -> dict[str, Any]:
    """The draft's osd-manifest.json, every file checked against it. `verified`: digests the
    caller has just checked itself (a registry version's); then the manifest must name the same
    digests and no file is hashed a second time."""
    if verified is None:
        try:
            return verify_manifest(directory)
        except DraftLoadError:
            raise
        except TargetError as e:
            raise DraftLoadError(f"cannot load draft from {directory}: {e}") from None
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        listed = {name: meta["sha256"] for name, meta in manifest["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise DraftLoadError(f"cannot load draft from {directory}: unreadable {MANIFEST} ({e})") from None
    differ = sorted(n for n, sha in listed.items() if verified.get(n) != sha)
    if differ:
        raise DraftLoadError(f"{directory}: {', '.join(differ)} not among the checked files or with another "
                             f"digest than {MANIFEST} lists")
    return manifest


def _read_info(directory: Path) -> tuple[dict[str, Any], DraftSpec, dict[str, Any], Any]:
    from transformers import AutoConfig

    try:
        info = json.loads((directory / INFO_FILE).read_text())
        spec = DraftSpec(**info["spec"])
        shared_meta: dict[str, Any] = info["shared_tensors"]
        cfg = AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as e:
        raise DraftLoadError(f"{directory}: unreadable {INFO_FILE} or {CONFIG_FILE}: {e}") from None
    if info.get("format") != DRAFT_FORMAT or info.get("kind") != "osd-draft":
        raise DraftLoadError(f"{directory}: draft format {info.get('format')!r} / kind {info.get('kind')!r}, "
                             f"this code reads format {DRAFT_FORMAT}")
    return info, spec, shared_meta, cfg


def _check_fits(directory: Path, cfg: Any, shared_meta: dict[str, Any], target_model: Any) -> None:
    tcfg = target_model.config
    if tcfg.vocab_size != cfg.vocab_size:
        raise DraftLoadError(f"{directory}: draft vocab {cfg.vocab_size} does not match the target's "
                             f"{tcfg.vocab_size}; this draft belongs to another target")
    if shared_meta and tcfg.hidden_size != cfg.hidden_size:
        raise DraftLoadError(f"{directory}: draft shares the target's tensors at hidden size {cfg.hidden_size}, "
                             f"the target's is {tcfg.hidden_size}; this draft belongs to another target")
    tsd = target_model.state_dict()
    for name, meta in shared_meta.items():
        t = tsd.get(name)
        if t is None or list(t.shape) != meta["shape"]:
            got = None if t is None else list(t.shape)
            raise DraftLoadError(f"{directory}: shared tensor {name} should be {meta['shape']}, "
                                 f"the target has {got}; this draft belongs to another target")


def version_payload(directory: Path) -> Path:
    """A file:// registry version's own directory (`<registry>/versions/<id>`, what `make demo`
    tells users to pass as a draft) as the draft it holds: the payload folder its manifest.json
    names. Any other directory as it is."""
    if (directory / MANIFEST).is_file():
        return directory
    try:
        payload = json.loads((directory / "manifest.json").read_text())["payload"]
    except (OSError, ValueError, KeyError, TypeError):
        return directory
    if not isinstance(payload, str) or "/" in payload:
        return directory
    inner = directory / payload
    return inner if inner.is_dir() else directory


def load_draft(directory: str | Path, target_model: Any, *, expect_target_sha256: str | None = None,
               verified: dict[str, str] | None = None) -> tuple[Any, dict[str, Any]]:
    """Load a draft saved by save_draft onto `target_model`'s shared tensors.

    `expect_target_sha256`: the target's identity (infra.target.target_identity); a draft
    recording another is refused. `verified`: see _checked_manifest.
    Returns (model, info) with info = draft.json plus "path". Raises DraftLoadError on a
    missing or corrupt directory or a target the draft does not fit."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = version_payload(Path(directory))
    if not directory.is_dir():
        raise DraftLoadError(f"draft directory {directory} does not exist")
    manifest = _checked_manifest(directory, verified)
    absent = {CONFIG_FILE, WEIGHTS_FILE, INFO_FILE} - set(manifest.get("files", {}))
    if absent:
        raise DraftLoadError(f"{directory} is not a saved draft: {MANIFEST} does not list {sorted(absent)}")
    info, spec, shared_meta, cfg = _read_info(directory)
    if spec.family == "head":
        from infra.drafts.head import load_head

        return load_head(directory, info, cfg, target_model, expect_target_sha256=expect_target_sha256)
    why = target_mismatch(info.get("target_ref"), expect_target_sha256)
    if why:
        raise DraftLoadError(f"the draft in {directory} was {why}")
    _check_fits(directory, cfg, shared_meta, target_model)

    tsd = target_model.state_dict()
    dtype, device = target_model.dtype, next(target_model.parameters()).device
    try:
        own = load_file(str(directory / WEIGHTS_FILE), device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise DraftLoadError(f"{directory / WEIGHTS_FILE} is unreadable: {e}") from None
    if set(own) != set(info["trainable_tensors"]):
        raise DraftLoadError(f"{directory / WEIGHTS_FILE} holds {sorted(own)}, {INFO_FILE} lists "
                             f"{info['trainable_tensors']}")
    tensors = {k: v.to(dtype) for k, v in own.items()}
    for name in shared_meta:
        tensors[name] = tsd[name]
    try:
        model = _assemble(cfg, tensors, set(shared_meta), dtype, device, target_model.generation_config)
    except (DraftSpecError, RuntimeError) as e:
        raise DraftLoadError(f"{directory}: tensors do not fit config.json: {e}") from None
    setattr(model, INDICES_ATTR, tuple(info.get("layer_indices") or ()))
    info = dict(info, path=str(directory), spec=spec.model_dump(mode="json"))
    return model, info
