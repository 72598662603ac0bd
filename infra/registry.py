"""The draft registry: immutable versions and moving aliases on any pyarrow filesystem.

Layout under the registry root (`registry.uri`; file://<state_dir>/registry by default,
s3://, gs:// and hdfs:// through pyarrow.fs):

    versions/<id>/manifest.json            the version exists iff this file parses and validates;
                                           its "target" is the draft's target_ref ({"spec", "sha256"})
    versions/<id>/<payload>/config.json    the draft's files (infra/drafts/layer.py format),
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

Publishing refuses a directory serving could not load: draft.json, config.json and
osd-manifest.json must parse and agree, and draft.safetensors must be a well-formed
safetensors file holding exactly the draft's trainable tensors at the shapes config.json
implies (checked from the file's header and a meta-device skeleton; no target needed).

On a local filesystem the payload, the manifest and the directories naming them are
fsynced before publish returns, and aliases are written, fsynced and renamed (then the
directory fsynced), so a power loss cannot leave a torn alias or a manifest vouching for
files that are not on disk. A write that fails (ENOSPC) removes what it wrote; gc sweeps
the temp files a crash left. An alias file that does not parse anyway is AliasUnreadable
(the replicas serve without a draft until a promote rewrites it). A cached copy of a remote
version that fails its digests is fetched again.

Aliases are whole-file replacements (rename on a local filesystem, one PUT on an object
store), so a reader sees the old alias or the new one. On a local registry alias writes and
gc's deletions take an exclusive flock on <root>/.lock, and gc re-reads the aliases under
it, so gc never deletes a version an alias was just pointed at (object stores have no lock:
there gc re-reads the aliases just before deleting, which narrows the race but cannot close
it). Loading a version checks every digest once, before it reads the safetensors (never
pickle), and refuses a version made for another target than the one it is loaded onto.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from infra.drafts.spec import target_mismatch as _target_mismatch
from infra.common.durable import TMP_MARK, fsync_path, sync_tree, write_durable, write_synced
from infra.common.faults import fault_point
from infra.target import LEAN_FAMILIES

MANIFEST = "manifest.json"
FORMAT = 1
ALIASES = ("stable", "canary")
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}")
_CHUNK = 1 << 20
# gc keeps the versions the newest audit entries name, so a person can still re-promote or
# re-canary what was just rolled back after looking into it.
AUDIT_PROTECT = 10
_ANY = object()  # "whatever the canary alias names": no compare-and-set


class RegistryError(RuntimeError):
    """A registry operation failed; the message says what to do."""


class VersionExists(RegistryError):
    pass


class VersionNotFound(RegistryError):
    pass


class DigestMismatch(RegistryError):
    pass


class AliasMoved(RegistryError):
    """The alias no longer names what the caller decided on (someone else moved it)."""


class AliasUnreadable(RegistryError):
    """An alias file exists but does not parse (torn by a crash, or edited by hand)."""


class WrongTarget(RegistryError):
    """The version was made for another target: loading it again cannot succeed."""


@dataclass(frozen=True)
class Version:
    id: str
    created_at: float
    payload: str
    files: dict[str, dict[str, Any]]
    lineage: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    target: dict[str, Any] = field(default_factory=dict)  # {"spec", "sha256"}: what it was made for

    @property
    def size(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())


def check_id(version: str) -> str:
    # fullmatch: `$` would also accept a trailing newline, which then names a file
    if not isinstance(version, str) or not _ID.fullmatch(version):
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
        self._tlock = threading.RLock()  # re-entrant: promote() holds it around set_stable()
        self._depth = 0
        self._lock_fd: int | None = None

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

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Alias writes and gc deletions one at a time, across threads and processes. flock
        conflicts between separate open()s even in one process, so two Registry objects on one
        directory exclude each other too. Object stores: the thread lock only (see module doc)."""
        with self._tlock:
            self._depth += 1
            try:
                if self._depth == 1 and self.local:
                    fd = os.open(self._p(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    self._lock_fd = fd
                yield
            finally:
                self._depth -= 1
                if self._depth == 0 and self._lock_fd is not None:
                    os.close(self._lock_fd)  # closing the only fd releases the flock
                    self._lock_fd = None

    def _replace_json(self, path: str, body: Any) -> None:
        """Readers see the old file or the new one, never a partial write."""
        data = json.dumps(body, indent=2, sort_keys=True).encode()
        if self.local:  # fsynced: an alias must not come back empty after a power loss
            write_durable(path, data)
        else:
            self._write_bytes(path, data)  # one PUT: atomic on object stores

    # -- versions -------------------------------------------------------------------

    def publish(self, src_dir: str | os.PathLike, version: str | None = None, *, lineage: dict | None = None,
                metrics: dict | None = None, target: dict | None = None,
                expect_target_sha256: str | None = None) -> Version:
        """Copy a draft directory in as a new immutable version (next vN when version is None).

        `target`: the manifest's target reference (default: the draft's own target_ref).
        `expect_target_sha256`: the configured target's identity; a draft made for another is refused."""
        src = Path(src_dir)
        if not src.is_dir():
            raise RegistryError(f"cannot publish {src}: not a directory")
        files = sorted(p for p in src.iterdir() if p.is_file())
        if not files:
            raise RegistryError(f"cannot publish {src}: it holds no files")
        try:
            info, expected = check_draft_dir(src)
        except RegistryError as e:
            raise RegistryError(f"cannot publish {src}: {e}") from None
        lineage = lineage if lineage is not None else info.get("lineage", {})
        metrics = metrics if metrics is not None else info.get("metrics", {})
        target = target if target is not None else info.get("target_ref") or {}
        why = _target_mismatch(target, expect_target_sha256)
        if why:
            raise RegistryError(f"cannot publish {src}: the draft was {why}")
        if version is not None:
            return self._publish_once(check_id(version), files, expected, lineage, metrics, target)
        for _ in range(100):  # concurrent auto-numbered publishes: the loser takes the next number
            try:
                return self._publish_once(self._next_id(), files, expected, lineage, metrics, target)
            except VersionExists:
                continue
        raise RegistryError("could not allocate a version id after 100 tries")

    def _next_id(self) -> str:
        nums = [int(m.group(1)) for v in self._version_dirs() if (m := re.fullmatch(r"v(\d+)", v))]
        return f"v{max(nums, default=0) + 1}"

    def _publish_once(self, version: str, files: list[Path], expected: dict[str, str], lineage: dict,
                      metrics: dict, target: dict) -> Version:
        vdir = self._p("versions", version)
        mpath = f"{vdir}/{MANIFEST}"
        if self._exists(mpath):
            raise VersionExists(f"version {version} already exists in {self.uri}; versions are immutable")
        payload = f"payload-{uuid.uuid4().hex[:12]}"
        try:
            digests = self._copy_payload(files, f"{vdir}/{payload}")
        except OSError as e:  # ENOSPC, a quota, a lost mount: no orphan waits for gc on a full disk
            if self._exists(f"{vdir}/{payload}"):
                self.fs.delete_dir(f"{vdir}/{payload}")
            raise RegistryError(f"cannot publish {files[0].parent}: {_one_line(e)}; nothing was published") from None
        # The draft's own manifest, checked against the digests taken while copying (no second pass).
        bad = sorted(n for n, sha in expected.items() if digests.get(n, {}).get("sha256") != sha)
        if bad:
            self.fs.delete_dir(f"{vdir}/{payload}")
            raise RegistryError(f"cannot publish {files[0].parent}: {', '.join(bad)} changed since its osd-manifest.json "
                                f"was written (corrupt, or edited by hand); re-save the draft")
        fault_point("registry.before_manifest")  # the payload copied, no manifest: not a version yet
        body = {"format": FORMAT, "version": version, "created_at": time.time(), "payload": payload,
                "files": digests, "lineage": lineage, "metrics": metrics, "target": target}
        data = json.dumps(body, indent=2, sort_keys=True).encode()
        if self.local:  # ... manifest last, created exclusively, then fsynced with its name
            tmp = Path(f"{vdir}/.{MANIFEST}.{payload}")
            try:
                write_synced(tmp, data)
                os.link(tmp, mpath)
            except FileExistsError:
                self.fs.delete_dir(f"{vdir}/{payload}")
                raise VersionExists(f"version {version} was published concurrently by another writer") from None
            except OSError as e:
                self.fs.delete_dir(f"{vdir}/{payload}")
                raise RegistryError(f"cannot publish {version}: {_one_line(e)}; nothing was published") from None
            finally:
                tmp.unlink(missing_ok=True)
            fsync_path(vdir)
        else:
            if self._exists(mpath):
                self.fs.delete_dir(f"{vdir}/{payload}")
                raise VersionExists(f"version {version} was published concurrently by another writer")
            self._write_bytes(mpath, data)
            if self._read_json(mpath).get("payload") != payload:
                raise VersionExists(f"version {version} was published concurrently by another writer")
        return _version(body)

    def _copy_payload(self, files: list[Path], dest: str) -> dict[str, dict[str, Any]]:
        """Copy the draft's files into `dest`, hashing as they go; on a local registry they are
        fsynced (files, then the directories naming them) before the manifest can vouch for them."""
        self.fs.create_dir(dest, recursive=True)
        digests: dict[str, dict[str, Any]] = {}
        for p in files:
            h = hashlib.sha256()
            with open(p, "rb") as src, self.fs.open_output_stream(f"{dest}/{p.name}") as dst:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    dst.write(chunk)
            digests[p.name] = {"sha256": h.hexdigest(), "size": p.stat().st_size}
        if self.local:
            sync_tree(dest)
        return digests

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
        return self._checked_files(self.get(version))

    def _checked_files(self, v: Version) -> Path:
        if self.local:
            return self._verify(v, self.payload_dir(v))
        path = self.cache_dir / v.id / v.payload
        if path.is_dir():
            try:
                return self._verify(v, path)
            except DigestMismatch:  # the cached copy went bad, maybe not the version: fetch it again
                shutil.rmtree(path, ignore_errors=True)
        self._fetch(v, path)
        return self._verify(v, path)

    def _fetch(self, v: Version, path: Path) -> None:
        """Copy a remote version into the cache, whole or not at all (a failed copy is removed)."""
        tmp = path.with_name(f".{path.name}{TMP_MARK}{uuid.uuid4().hex[:8]}")
        tmp.mkdir(parents=True)
        try:
            for name in v.files:
                with self.fs.open_input_stream(self._p("versions", v.id, v.payload, name)) as src, \
                        open(tmp / name, "wb") as dst:
                    while chunk := src.read(_CHUNK):
                        dst.write(chunk)
            os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @staticmethod
    def _verify(v: Version, path: Path) -> Path:
        for name, meta in v.files.items():
            p = path / name
            if not p.is_file():
                raise DigestMismatch(f"version {v.id}: {name} is missing")
            if p.stat().st_size != int(meta["size"]) or _sha256(p) != meta["sha256"]:
                raise DigestMismatch(f"version {v.id}: {name} does not match its sha256 in {MANIFEST}; "
                                     f"the version is corrupt and will not be loaded")
        return path

    def load_draft(self, version: str, target_model: Any, *,
                   expect_target_sha256: str | None = None) -> tuple[Any, dict[str, Any]]:
        """The version's draft on `target_model`'s shared tensors, after the digest check.
        `expect_target_sha256`: the target's identity; a version made for another is refused
        before any file is read. A version that is not a loadable draft is a RegistryError
        with one line saying why."""
        from infra.drafts.layer import DraftLoadError, DraftSpecError, load_draft

        v = self.get(version)
        why = _target_mismatch(v.target, expect_target_sha256)
        if why:
            raise WrongTarget(f"version {version} cannot be loaded: it was {why}")
        path = self._checked_files(v)
        # Every file was just hashed against this manifest: the draft's own osd-manifest.json
        # is compared with those digests instead of hashing each file a second time.
        verified = {name: meta["sha256"] for name, meta in v.files.items()}
        try:
            check_draft_dir(path)  # versions published before publish checked this
            model, info = load_draft(path, target_model, expect_target_sha256=expect_target_sha256,
                                     verified=verified)
        except RegistryError as e:
            raise RegistryError(f"version {version} cannot be loaded: {e}") from None
        except (DraftLoadError, DraftSpecError) as e:
            raise RegistryError(f"version {version} cannot be loaded: {_one_line(e)}") from None
        return model, dict(info, version=version)

    # -- aliases ----------------------------------------------------------------------

    def alias(self, name: str) -> dict[str, Any] | None:
        if name not in ALIASES:
            raise RegistryError(f"unknown alias {name!r}: aliases are {', '.join(ALIASES)}")
        path = self._p("aliases", f"{name}.json")
        try:
            body = self._read_json(path)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise AliasUnreadable(f"alias file {path} is unreadable ({_one_line(e)}); "
                                  f"`osd registry promote <version>` rewrites it") from None
        if not isinstance(body, dict) or not isinstance(body.get("version"), str):
            raise AliasUnreadable(f"alias file {path} names no version; `osd registry promote <version>` rewrites it")
        return body

    def aliases(self) -> dict[str, dict[str, Any] | None]:
        return {name: self.alias(name) for name in ALIASES}

    def _expect_canary(self, expect: Any) -> None:
        """Compare-and-set: refuse when the canary alias no longer names `expect` (None: no canary)."""
        if expect is _ANY:
            return
        cur = self.alias("canary")
        now = cur["version"] if cur else None
        if now != expect:
            raise AliasMoved(f"the canary alias names {now or 'nothing'}, not {expect or 'nothing'}: "
                             f"someone else moved it, so this change was not made")

    def set_stable(self, version: str, reason: str = "") -> dict[str, Any]:
        with self._locked():
            self.get(version)  # must exist; under the lock, so gc cannot delete it before the write
            try:
                cur = self.alias("stable")
            except AliasUnreadable:  # a torn alias is what this write repairs; its previous is lost
                cur = None
            previous = cur["version"] if cur and cur["version"] != version else (cur or {}).get("previous")
            return self._write_stable(version, previous, reason)

    def _write_stable(self, version: str, previous: str | None, reason: str) -> dict[str, Any]:
        body = {"version": version, "previous": previous, "updated_at": time.time(), "reason": reason}
        self._replace_json(self._p("aliases", "stable.json"), body)
        return body

    def set_canary(self, version: str, weight: float, reason: str = "", *, expect: Any = _ANY) -> dict[str, Any]:
        """canary := version at `weight`; with `expect` only if the canary alias still names it
        (None: only if there is no canary), else AliasMoved."""
        if not 0.0 < weight <= 1.0:
            raise RegistryError(f"canary weight must be in (0, 1], got {weight}")
        with self._locked():
            self._expect_canary(expect)
            self.get(version)
            body = {"version": version, "weight": float(weight), "updated_at": time.time(), "reason": reason}
            self._replace_json(self._p("aliases", "canary.json"), body)
            return body

    def clear_canary(self, *, expect: Any = _ANY) -> None:
        path = self._p("aliases", "canary.json")
        with self._locked():
            self._expect_canary(expect)
            if self._exists(path):
                self.fs.delete_file(path)

    def promote(self, version: str, reason: str = "promoted", *, expect_canary: Any = _ANY) -> dict[str, Any]:
        """stable := version (the old stable is kept as `previous`); the canary is cleared."""
        with self._locked():
            self._expect_canary(expect_canary)
            body = self.set_stable(version, reason)
            self.clear_canary()
            return body

    def rollback(self, reason: str = "rollback") -> dict[str, Any]:
        """Drop the canary if there is one; otherwise move stable back to its previous version.
        Recorded in the audit log, so the rollout controller does not start that version again."""
        with self._locked():
            canary, stable = self.alias("canary"), self.alias("stable")
            if canary:
                undone = canary["version"]
                out = {"dropped_canary": undone, "stable": (stable or {}).get("version")}
            elif stable and stable.get("previous"):
                self.get(stable["previous"])  # must still exist
                undone = stable["version"]
                out = {"stable": stable["previous"], "from": undone}
            else:
                raise RegistryError("nothing to roll back: no canary, and stable has no previous version")
            # The entry goes first: a controller that sees the alias gone must also see why.
            self.audit({"action": "rollback", "version": undone, "reason": reason, "manual": True, **out})
            if canary:
                self.clear_canary()
            else:  # one step back, with no previous: rolling back again needs an explicit promote
                self._write_stable(out["stable"], None, reason)
            return out

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

    def audit_log(self, last: int | None = None) -> list[dict[str, Any]]:
        """Decision records, oldest first; only the newest `last` when given."""
        import pyarrow.fs as pafs

        infos = self.fs.get_file_info(pafs.FileSelector(self._p("audit"), allow_not_found=True))
        files = sorted((i for i in infos if i.type == pafs.FileType.File and i.base_name.endswith(".json")),
                       key=lambda i: i.base_name)
        out = []
        for i in files[-last:] if last is not None else files:
            try:
                out.append(self._read_json(i.path))
            except (OSError, ValueError):
                continue
        return out

    # -- garbage collection -----------------------------------------------------------------

    def _protected(self) -> set[str]:
        """Versions gc keeps whatever their age: each alias's version, stable's previous, and
        the versions the newest AUDIT_PROTECT audit entries name."""
        keep = {a.get(k) for a in self.aliases().values() if a for k in ("version", "previous")}
        keep |= {e.get("version") for e in self.audit_log(last=AUDIT_PROTECT) if isinstance(e, dict)}
        return {v for v in keep if isinstance(v, str)}

    def gc(self, keep_last: int, orphan_age_s: float = 3600.0) -> list[str]:
        """Delete versions that are not protected (aliases, recent audit entries) and not among
        the newest `keep_last` (>= 1); also payloads no manifest names, older than orphan_age_s."""
        import pyarrow.fs as pafs

        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise RegistryError(f"gc keep_last must be a whole number >= 1, got {keep_last!r} "
                                f"(the newest version is always kept, so no version id is ever reused)")
        removed: list[str] = []
        with self._locked():  # what is protected is read under the lock that alias writes take
            versions = self.list()
            keep = self._protected() | {v.id for v in versions[-keep_last:]}
            for v in versions:
                if v.id not in keep:
                    self.fs.delete_file(self._p("versions", v.id, MANIFEST))  # first: the version stops existing
                    self.fs.delete_dir(self._p("versions", v.id))
                    removed.append(v.id)
        live = {v.id: v.payload for v in versions if v.id in keep}
        now = time.time()
        removed += self._sweep_temp(now - orphan_age_s)
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

    def _sweep_temp(self, before: float) -> list[str]:
        """Temp files older than `before` (epoch s) that a crash or a full disk left behind: an
        alias's or a manifest's, never renamed into place. Local registries only (object
        stores write in one PUT and leave none)."""
        if not self.local:
            return []
        root = Path(self.root)
        dirs = [root / "aliases", *(p for p in (root / "versions").iterdir() if p.is_dir())]
        removed = []
        for d in dirs:
            for p in d.iterdir():
                temp = TMP_MARK in p.name or p.name.startswith(f".{MANIFEST}.")
                if temp and p.is_file() and p.stat().st_mtime < before:
                    p.unlink(missing_ok=True)
                    removed.append(str(p.relative_to(root)))
        return removed

    def __iter__(self) -> Iterator[Version]:
        return iter(self.list())


def _version(body: dict[str, Any]) -> Version:
    return Version(id=body["version"], created_at=float(body["created_at"]), payload=body["payload"],
                   files=body["files"], lineage=body.get("lineage") or {}, metrics=body.get("metrics") or {},
                   target=body.get("target") or body.get("tokenizer") or {})


def _sha256(path: Path) -> str:
    from infra.target import sha256_file

    return sha256_file(path)


# -- what publish and load check: a directory serving can load, without the target ----------

DRAFT_FILES = ("draft.json", "config.json", "draft.safetensors", "osd-manifest.json")
# safetensors dtype -> bytes per element
_ST_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
              "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
_MAX_HEADER = 100 << 20


def _one_line(e: BaseException) -> str:
    return "; ".join(line.strip() for line in str(e).splitlines() if line.strip())


def _json_object(path: Path) -> dict[str, Any]:
    try:
        body = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise RegistryError(f"{path.name} is not valid JSON ({_one_line(e)})") from None
    if not isinstance(body, dict):
        raise RegistryError(f"{path.name} is not a JSON object")
    return body


def safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """Tensor name -> {"dtype", "shape", "data_offsets"} from a safetensors file's header, after
    checking that the entries are well formed and their data exactly fills the rest of the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
        if not 0 < n <= min(size - 8, _MAX_HEADER):
            raise RegistryError(f"{path.name} is not a safetensors file (no valid header length)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            header = None
    if not isinstance(header, dict):
        raise RegistryError(f"{path.name} is not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    spans = []
    for name, t in header.items():
        try:
            start, end = t["data_offsets"]
            shape = t["shape"]
            ok = (all(isinstance(d, int) and d >= 0 for d in shape) and isinstance(start, int)
                  and end - start == math.prod(shape) * _ST_DTYPES[t["dtype"]])
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise RegistryError(f"{path.name}: tensor {name!r} has a malformed header entry")
        spans.append((start, end))
    # The spans must tile the data section exactly: no gaps, no overlaps, nothing past the end.
    pos, tiled = 0, True
    for start, end in sorted(spans):
        tiled = tiled and start == pos
        pos = end
    if not tiled or pos != size - 8 - n:
        raise RegistryError(f"{path.name}: tensor data does not match the header (truncated or corrupt)")
    return header


def _skeleton_shapes(directory: Path, config: dict[str, Any]) -> dict[str, list[int]]:
    """State-dict shapes of the draft config.json describes, built on the meta device (no memory)."""
    if config.get("model_type") not in LEAN_FAMILIES:
        raise RegistryError(f"config.json: model_type {config.get('model_type')!r}; drafts are models of "
                            f"{', '.join(LEAN_FAMILIES)}")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        cfg = AutoConfig.from_pretrained(directory, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception as e:  # transformers raises many types for a config it cannot build
        raise RegistryError(f"config.json does not describe a buildable model ({_one_line(e)[:200]})") from None
    return {k: list(v.shape) for k, v in model.state_dict().items()}


def _head_shapes(directory: Path, spec: Any, header: dict[str, Any]) -> dict[str, list[int]]:
    """The tensor shapes a head draft (infra/drafts/head.py) of `spec` has on config.json's target."""
    from transformers import AutoConfig

    from infra.drafts.head import head_shapes

    if "d2t" not in header:
        raise RegistryError("a head draft's draft.safetensors has no d2t (its draft vocabulary)")
    try:
        cfg = AutoConfig.from_pretrained(directory, local_files_only=True)
        shapes = head_shapes(cfg, spec, header["d2t"]["shape"][0])
    except Exception as e:
        raise RegistryError(f"config.json does not describe the head's target ({_one_line(e)[:200]})") from None
    return {**shapes, "model.embed_tokens.weight": [cfg.vocab_size, cfg.hidden_size]}


def check_draft_dir(directory: str | os.PathLike) -> tuple[dict[str, Any], dict[str, str]]:
    """(draft.json, {file: sha256 from osd-manifest.json}) of a directory infra.drafts.layer.load_draft
    can load onto a fitting target; RegistryError naming the first thing that would stop it."""
    from infra.drafts.layer import DRAFT_FORMAT, DraftSpec

    d = Path(directory)
    missing = [n for n in DRAFT_FILES if not (d / n).is_file()]
    if missing:
        raise RegistryError(f"not a saved draft: {', '.join(missing)} missing (drafts are written by "
                            f"`osd draft init` or the trainer)")
    info, config, manifest = (_json_object(d / n) for n in ("draft.json", "config.json", "osd-manifest.json"))
    if info.get("format") != DRAFT_FORMAT or info.get("kind") != "osd-draft":
        raise RegistryError(f"draft.json: format {info.get('format')!r} / kind {info.get('kind')!r}, "
                            f"expected format {DRAFT_FORMAT} / kind 'osd-draft'")
    try:
        spec = DraftSpec(**info["spec"])
        shared = {k: list(v["shape"]) for k, v in info["shared_tensors"].items()}
        trainable = set(info["trainable_tensors"])
        listed = manifest["files"]
        expected = {n: listed[n]["sha256"] for n in DRAFT_FILES[:3]}
    except Exception as e:  # missing keys, wrong types, a spec pydantic refuses
        raise RegistryError(f"draft.json or osd-manifest.json lacks a required field or has a bad one "
                            f"({type(e).__name__}: {_one_line(e)[:200]})") from None
    header = safetensors_header(d / "draft.safetensors")
    if set(header) != trainable:
        raise RegistryError(f"draft.safetensors holds {len(header)} tensors that differ from the "
                            f"{len(trainable)} draft.json lists as trainable")
    shapes = _head_shapes(d, spec, header) if spec.family == "head" else _skeleton_shapes(d, config)
    if set(shapes) != trainable | set(shared) or trainable & set(shared):
        raise RegistryError("draft.json's trainable and shared tensors do not make up the model config.json "
                            "describes")
    for name in sorted(shapes):
        got = header[name]["shape"] if name in header else shared[name]
        if got != shapes[name]:
            raise RegistryError(f"tensor {name} is {got}, config.json implies {shapes[name]}")
    return info, expected
