"""The files of a draft directory, shared by both draft families (infra/drafts/layer.py, the
layer draft; infra/drafts/head.py, the head): their names, the format number, and the atomic
write that puts them on disk (infra/drafts/layer.py's module doc describes the layout)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from infra.target import write_manifest

DRAFT_FORMAT = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "draft.safetensors"
INFO_FILE = "draft.json"


def forget_source_path(cfg: Any) -> Any:
    """Drop the path the target was loaded from out of a draft's config, in place: a saved
    draft must not name a file on the machine that built it."""
    for key in ("_name_or_path", "_model_name_or_path"):
        if hasattr(cfg, key):
            try:
                delattr(cfg, key)
            except AttributeError:
                pass
    return cfg


def write_draft_dir(directory: Path, config: Any, tensors: dict[str, torch.Tensor], info: dict[str, Any]) -> Path:
    """config.json, draft.safetensors, draft.json and the manifest (last), written to a temp dir
    beside `directory` and renamed over it: a reader sees the old draft or the new, never half."""
    from safetensors.torch import save_file

    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        config.to_json_file(tmp / CONFIG_FILE, use_diff=False)
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "osd.kind": "draft"})
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
        write_manifest(tmp, {"kind": "osd-draft"})  # last: its presence means complete
        if directory.exists():
            old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
            os.replace(directory, old)
            os.replace(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, directory)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return directory
