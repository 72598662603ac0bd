"""Writes that survive a crash of the machine: fsync the file, then the directory that names it.

A rename is atomic but not durable until the directory is fsynced; a file written and not
fsynced can come back empty after a power loss (the torn alias file of issue 44).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

# Temp files are named <.name><TMP_MARK><random>, so a sweep can tell them from real files.
TMP_MARK = ".tmp-"


def fsync_path(path: str | Path) -> None:
    """fsync a file, or a directory (which makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: str | Path) -> None:
    """fsync every file and directory under `root`, and root's own name in its parent."""
    root = Path(root)
    for dirpath, _, filenames in os.walk(root, topdown=False):  # names after their contents
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(dirpath)
    fsync_path(root.parent)


def write_synced(path: str | Path, data: bytes) -> None:
    """Write `data` to a new file and fsync it (its name is the caller's to make durable)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_durable(path: str | Path, data: bytes) -> None:
    """Write, fsync, rename into place, fsync the directory: the file is whole or absent. A
    write that fails (ENOSPC) removes its temp file, so a full disk leaves no litter."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}{TMP_MARK}{uuid.uuid4().hex[:8]}")
    try:
        write_synced(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
