"""The draft registry: immutable versions and moving aliases on any pyarrow filesystem.

Layout under the registry root (`registry.uri`; file://<state_dir>/registry by default,
s3://, gs:// and hdfs:// through pyarrow.fs):

    versions/<id>/manifest.json            the version exists iff this file parses and validates
    versions/<id>/<payload>/config.json    the draft's files (train/draft_model.py format),
    versions/<id>/<payload>/draft.safetensors   written before the manifest that names them
    versions/<id>/<payload>/draft.json ...
    aliases/stable.json                    {"version", "previous", "updated_at", "reason"}
    aliases/canary.json                    {"version", "weight", "updated_at", "reason"}
    audit/<time>-<version>-<action>.json   one file per rollout decision, with its evidence

Publishing writes the payload under a fresh name first, then the manifest, which lists the
payload and a sha256 + size for each of its files. A crash before the manifest leaves an
orphan payload that `gc` removes; readers never see it. The manifest is created
exclusively: on a local filesystem by hard-linking a finished temp file (link(2) fails if
the name exists), so of two concurrent publishes of one id exactly one wins. Object stores
reached through pyarrow have no create-if-absent, so there the publisher checks before
writing and reads the manifest back after; the loser of a race inside that window is told
so (and its payload, under its own name, is never the one the manifest points to).

Aliases are whole-file replacements (rename on a local filesystem, one PUT on an object
store), so a reader sees the old alias or the new one. Loading a version checks every
digest before it reads the safetensors (never pickle).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

MANIFEST = "manifest.json"
FORMAT = 1
ALIASES = ("stable", "canary")
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$")
_CHUNK = 1 << 20


class RegistryError(RuntimeError):
    """A registry operation failed; the message says what to do."""


class VersionExists(RegistryError):
    pass


class VersionNotFound(RegistryError):
    pass


class DigestMismatch(RegistryError):
    pass


@dataclass(frozen=True)
class Version:
    id: str
    created_at: float
    payload: str
    files: dict[str, dict[str, Any]]
    lineage: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    tokenizer: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())


def check_id(version: str) -> str:
    if not isinstance(version, str) or not _ID.match(version):
        raise RegistryError(f"bad version id {version!r}: use letters, digits, '.', '_' or '-' (at most 80)")
    return version


def default_uri(state_dir: str | os.PathLike) -> str:
    return Path(state_dir).expanduser().resolve().joinpath("registry").as_uri()


class Registry:
    def __init__(self, uri: str, cache_dir: str | os.PathLike | None = None):
        import pyarrow.fs as pafs

        self.uri = uri
        try:
            self.fs, root = pafs.FileSystem.from_uri(uri)
        except Exception as e:
            raise RegistryError(f"registry uri {uri!r} is not a filesystem pyarrow can open: {e}") from None
        self.root = root.rstrip("/")
        self.local = isinstance(self.fs, pafs.LocalFileSystem)
        # Remote versions are copied here before loading; local ones are read in place.
        self.cache_dir = Path(cache_dir or Path.home() / ".cache" / "osd" / "registry").expanduser()
        self.fs.create_dir(self._p("versions"), recursive=True)
        self.fs.create_dir(self._p("aliases"), recursive=True)

    @classmethod
    def from_config(cls, cfg: Any) -> "Registry":
        uri = cfg.registry.uri or default_uri(cfg.state_dir)
        return cls(uri, cache_dir=Path(cfg.state_dir) / "registry-cache")

    # -- paths and small I/O ------------------------------------------------------

    def _p(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def _exists(self, path: str) -> bool:
        import pyarrow.fs as pafs

        return self.fs.get_file_info(path).type != pafs.FileType.NotFound

    def _read_json(self, path: str) -> Any:
        with self.fs.open_input_stream(path) as f:
            return json.loads(f.read().decode())

    def _write_bytes(self, path: str, data: bytes) -> None:
        with self.fs.open_output_stream(path) as f:
            f.write(data)

    def _replace_json(self, path: str, body: Any) -> None:
        """Readers see the old file or the new one, never a partial write."""
        data = json.dumps(body, indent=2, sort_keys=True).encode()
        if self.local:
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            Path(tmp).write_bytes(data)
            os.replace(tmp, path)
        else:
            self._write_bytes(path, data)  # one PUT: atomic on object stores

    # -- versions -------------------------------------------------------------------

    def publish(self, src_dir: str | os.PathLike, version: str | None = None, *, lineage: dict | None = None,
                metrics: dict | None = None, tokenizer: dict | None = None) -> Version:
        """Copy a draft directory in as a new immutable version (next vN when version is None)."""
        src = Path(src_dir)
        if not src.is_dir():
            raise RegistryError(f"cannot publish {src}: not a directory")
        files = sorted(p for p in src.iterdir() if p.is_file())
        if not files:
            raise RegistryError(f"cannot publish {src}: it holds no files")
        info = {}
        if (src / "draft.json").is_file():
            info = json.loads((src / "draft.json").read_text())
        lineage = lineage if lineage is not None else info.get("lineage", {})
        metrics = metrics if metrics is not None else info.get("metrics", {})
        tokenizer = tokenizer if tokenizer is not None else info.get("target_ref", {})
        if version is not None:
            return self._publish_once(check_id(version), files, lineage, metrics, tokenizer)
        for _ in range(100):  # concurrent auto-numbered publishes: the loser takes the next number
            try:
                return self._publish_once(self._next_id(), files, lineage, metrics, tokenizer)
            except VersionExists:
                continue
        raise RegistryError("could not allocate a version id after 100 tries")

    def _next_id(self) -> str:
        nums = [int(m.group(1)) for v in self._version_dirs() if (m := re.fullmatch(r"v(\d+)", v))]
        return f"v{max(nums, default=0) + 1}"

    def _publish_once(self, version: str, files: list[Path], lineage: dict, metrics: dict,
                      tokenizer: dict) -> Version:
        vdir = self._p("versions", version)
        mpath = f"{vdir}/{MANIFEST}"
        if self._exists(mpath):
            raise VersionExists(f"version {version} already exists in {self.uri}; versions are immutable")
        payload = f"payload-{uuid.uuid4().hex[:12]}"
        self.fs.create_dir(f"{vdir}/{payload}", recursive=True)
        digests: dict[str, dict[str, Any]] = {}
        for p in files:  # files first ...
            h = hashlib.sha256()
            with open(p, "rb") as src, self.fs.open_output_stream(f"{vdir}/{payload}/{p.name}") as dst:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    dst.write(chunk)
            digests[p.name] = {"sha256": h.hexdigest(), "size": p.stat().st_size}
        body = {"format": FORMAT, "version": version, "created_at": time.time(), "payload": payload,
                "files": digests, "lineage": lineage, "metrics": metrics, "tokenizer": tokenizer}
        data = json.dumps(body, indent=2, sort_keys=True).encode()
        if self.local:  # ... manifest last, created exclusively
            tmp = Path(f"{vdir}/.{MANIFEST}.{payload}")
            tmp.write_bytes(data)
            try:
                os.link(tmp, mpath)
            except FileExistsError:
                self.fs.delete_dir(f"{vdir}/{payload}")
                raise VersionExists(f"version {version} was published concurrently by another writer") from None
            finally:
                tmp.unlink(missing_ok=True)
        else:
            if self._exists(mpath):
                self.fs.delete_dir(f"{vdir}/{payload}")
                raise VersionExists(f"version {version} was published concurrently by another writer")
            self._write_bytes(mpath, data)
            if self._read_json(mpath).get("payload") != payload:
                raise VersionExists(f"version {version} was published concurrently by another writer")
        return _version(body)

    def _version_dirs(self) -> list[str]:
        import pyarrow.fs as pafs

        infos = self.fs.get_file_info(pafs.FileSelector(self._p("versions"), allow_not_found=True))
        return [i.base_name for i in infos if i.type == pafs.FileType.Directory]

    def get(self, version: str) -> Version:
        """The version's manifest; VersionNotFound if it has none (absent or never finished)."""
        mpath = self._p("versions", check_id(version), MANIFEST)
        try:
            body = self._read_json(mpath)
        except FileNotFoundError:
            raise VersionNotFound(f"version {version} does not exist in {self.uri}") from None
        except (OSError, ValueError) as e:
            raise RegistryError(f"version {version}: unreadable {MANIFEST}: {e}") from None
        if body.get("format") != FORMAT or body.get("version") != version or "files" not in body:
            raise RegistryError(f"version {version}: {MANIFEST} is not a format-{FORMAT} manifest for it")
        return _version(body)

    def list(self) -> list[Version]:
        """Every complete version, oldest first (incomplete and corrupt manifests are skipped)."""
        out = []
        for name in self._version_dirs():
            try:
                out.append(self.get(name))
            except RegistryError:
                continue
        return sorted(out, key=lambda v: (v.created_at, v.id))

    def exists(self, version: str) -> bool:
        try:
            self.get(version)
            return True
        except RegistryError:
            return False

    def payload_dir(self, v: Version) -> Path:
        """Where a version's files are on a local registry (no digest check: see local_path)."""
        if not self.local:
            raise RegistryError(f"{self.uri} is not a local filesystem; use local_path()")
        return Path(self._p("versions", v.id, v.payload))

    def local_path(self, version: str) -> Path:
        """A local directory with the version's files, every digest checked (DigestMismatch if not)."""
        v = self.get(version)
        if self.local:
            path = self.payload_dir(v)
        else:
            path = self.cache_dir / version / v.payload
            if not path.is_dir():
                tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
                tmp.mkdir(parents=True)
                for name in v.files:
                    with self.fs.open_input_stream(self._p("versions", version, v.payload, name)) as src, \
                            open(tmp / name, "wb") as dst:
                        while chunk := src.read(_CHUNK):
                            dst.write(chunk)
                os.replace(tmp, path)
        for name, meta in v.files.items():
            p = path / name
            if not p.is_file():
                raise DigestMismatch(f"version {version}: {name} is missing")
            if p.stat().st_size != int(meta["size"]) or _sha256(p) != meta["sha256"]:
                raise DigestMismatch(f"version {version}: {name} does not match its sha256 in {MANIFEST}; "
                                     f"the version is corrupt and will not be loaded")
        return path

    def load_draft(self, version: str, target_model: Any) -> tuple[Any, dict[str, Any]]:
        """The version's draft on `target_model`'s shared tensors, after the digest check."""
        from train.draft_model import load_draft

        model, info = load_draft(self.local_path(version), target_model)
        return model, dict(info, version=version)

    # -- aliases ----------------------------------------------------------------------

    def alias(self, name: str) -> dict[str, Any] | None:
        if name not in ALIASES:
            raise RegistryError(f"unknown alias {name!r}: aliases are {', '.join(ALIASES)}")
        try:
            return self._read_json(self._p("aliases", f"{name}.json"))
        except FileNotFoundError:
            return None

    def aliases(self) -> dict[str, dict[str, Any] | None]:
        return {name: self.alias(name) for name in ALIASES}

    def set_stable(self, version: str, reason: str = "") -> dict[str, Any]:
        self.get(version)  # must exist
        cur = self.alias("stable")
        previous = cur["version"] if cur and cur["version"] != version else (cur or {}).get("previous")
        return self._write_stable(version, previous, reason)

    def _write_stable(self, version: str, previous: str | None, reason: str) -> dict[str, Any]:
        body = {"version": version, "previous": previous, "updated_at": time.time(), "reason": reason}
        self._replace_json(self._p("aliases", "stable.json"), body)
        return body

    def set_canary(self, version: str, weight: float, reason: str = "") -> dict[str, Any]:
        if not 0.0 < weight <= 1.0:
            raise RegistryError(f"canary weight must be in (0, 1], got {weight}")
        self.get(version)
        body = {"version": version, "weight": float(weight), "updated_at": time.time(), "reason": reason}
        self._replace_json(self._p("aliases", "canary.json"), body)
        return body

    def clear_canary(self) -> None:
        path = self._p("aliases", "canary.json")
        if self._exists(path):
            self.fs.delete_file(path)

    def promote(self, version: str, reason: str = "promoted") -> dict[str, Any]:
        """stable := version (the old stable is kept as `previous`); the canary is cleared."""
        body = self.set_stable(version, reason)
        self.clear_canary()
        return body

    def rollback(self, reason: str = "rollback") -> dict[str, Any]:
        """Drop the canary if there is one; otherwise move stable back to its previous version."""
        canary = self.alias("canary")
        if canary:
            self.clear_canary()
            return {"dropped_canary": canary["version"], "stable": (self.alias("stable") or {}).get("version")}
        stable = self.alias("stable")
        if not stable or not stable.get("previous"):
            raise RegistryError("nothing to roll back: no canary, and stable has no previous version")
        self.get(stable["previous"])  # must still exist
        # One step back, with no previous: rolling back again needs an explicit promote.
        body = self._write_stable(stable["previous"], None, reason)
        return {"stable": body["version"], "from": stable["version"]}

    # -- audit log ----------------------------------------------------------------------

    def audit(self, entry: dict[str, Any]) -> str:
        """Write one decision record; returns its path. One file each, so object stores need no append."""
        self.fs.create_dir(self._p("audit"), recursive=True)
        ts = time.time()
        name = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(ts))}-{int(ts * 1e6) % 1000000:06d}-" \
               f"{entry.get('version', 'none')}-{entry.get('action', 'note')}.json"
        path = self._p("audit", name)
        self._write_bytes(path, json.dumps({"time": ts, **entry}, indent=2, sort_keys=True, default=str).encode())
        return path

    def audit_log(self) -> list[dict[str, Any]]:
        import pyarrow.fs as pafs

        infos = self.fs.get_file_info(pafs.FileSelector(self._p("audit"), allow_not_found=True))
        out = []
        for i in sorted(infos, key=lambda i: i.base_name):
            if i.type == pafs.FileType.File and i.base_name.endswith(".json"):
                try:
                    out.append(self._read_json(i.path))
                except (OSError, ValueError):
                    continue
        return out

    # -- garbage collection -----------------------------------------------------------------

    def gc(self, keep_last: int, orphan_age_s: float = 3600.0) -> list[str]:
        """Delete versions that no alias names (stable, its previous, canary) and that are not
        among the newest `keep_last`; also payloads no manifest names, older than orphan_age_s."""
        import pyarrow.fs as pafs

        keep = {a.get(k) for a in self.aliases().values() if a for k in ("version", "previous")} - {None}
        versions = self.list()
        keep |= {v.id for v in versions[-keep_last:]} if keep_last > 0 else set()
        removed = []
        for v in versions:
            if v.id not in keep:
                self.fs.delete_file(self._p("versions", v.id, MANIFEST))  # first: the version stops existing
                self.fs.delete_dir(self._p("versions", v.id))
                removed.append(v.id)
        live = {v.id: v.payload for v in versions if v.id in keep}
        now = time.time()
        for name in self._version_dirs():
            vdir = self._p("versions", name)
            for i in self.fs.get_file_info(pafs.FileSelector(vdir, allow_not_found=True)):
                if i.type != pafs.FileType.Directory or i.base_name == live.get(name):
                    continue
                mtime = i.mtime.timestamp() if i.mtime is not None else 0.0
                if now - mtime >= orphan_age_s:
                    self.fs.delete_dir(i.path)
                    removed.append(f"{name}/{i.base_name}")
        return removed

    def __iter__(self) -> Iterator[Version]:
        return iter(self.list())


def _version(body: dict[str, Any]) -> Version:
    return Version(id=body["version"], created_at=float(body["created_at"]), payload=body["payload"],
                   files=body["files"], lineage=body.get("lineage") or {}, metrics=body.get("metrics") or {},
                   tokenizer=body.get("tokenizer") or {})


def _sha256(path: Path) -> str:
    from pipeline.target import sha256_file

    return sha256_file(path)
