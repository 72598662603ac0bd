"""The registry on a full disk (ENOSPC part-way through a write), after a crash that left temp
files, with a corrupt cached copy of a remote version, and its fsyncs: no half-written version
is ever loadable, aliases keep naming a good version, and no litter outlives gc."""

import errno
import os
import time

import pytest

from infra.registry import Registry, RegistryError

pytestmark = pytest.mark.pure


class _FullAfter:
    """A pyarrow filesystem whose writes fail with ENOSPC once `budget` bytes are written."""

    def __init__(self, fs, budget: int):
        self._fs, self.budget = fs, budget

    def __getattr__(self, name):
        return getattr(self._fs, name)

    def open_output_stream(self, path, *a, **k):
        real, outer = self._fs.open_output_stream(path, *a, **k), self

        class Stream:
            def write(self, data):
                if len(data) > outer.budget:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                outer.budget -= len(data)
                return real.write(data)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                real.close()

        return Stream()


def _litter(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".tmp-" in p.name or p.name.startswith(".manifest"))


def test_publish_on_a_full_disk_leaves_nothing_loadable_and_no_payload(tmp_path, draft_dir):
    reg = Registry(tmp_path.joinpath("reg").as_uri())
    reg.publish(draft_dir, "v1")
    reg.fs = _FullAfter(reg.fs, budget=1000)
    with pytest.raises(RegistryError, match="No space left"):
        reg.publish(draft_dir, "v2")
    assert [v.id for v in reg.list()] == ["v1"] and not reg.exists("v2")
    assert not list((tmp_path / "reg" / "versions" / "v2").glob("payload-*"))  # removed at once, not at gc


def test_an_alias_write_on_a_full_disk_keeps_the_old_alias(tmp_path, draft_dir, monkeypatch):
    reg = Registry(tmp_path.joinpath("reg").as_uri())
    reg.publish(draft_dir, "v1")
    reg.publish(draft_dir, "v2")
    reg.promote("v1")
    real_fsync = os.fsync

    def full(fd):  # the data never reaches the disk: the write fails at its fsync
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        reg.promote("v2")
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert reg.alias("stable")["version"] == "v1"
    assert _litter(tmp_path / "reg") == []


def test_gc_collects_temp_files_a_crash_left(tmp_path, draft_dir):
    reg = Registry(tmp_path.joinpath("reg").as_uri())
    reg.publish(draft_dir, "v1")
    root = tmp_path / "reg"
    stale = [root / "aliases" / ".stable.json.tmp-dead0001", root / "versions" / "v1" / ".manifest.json.payload-x"]
    for p in stale:
        p.write_bytes(b"{")
        os.utime(p, (time.time() - 7200, time.time() - 7200))
    fresh = root / "aliases" / ".canary.json.tmp-live0001"  # a write in progress: younger than orphan_age_s
    fresh.write_bytes(b"{")
    reg.gc(keep_last=5)
    assert _litter(root) == [str(fresh.relative_to(root))]


def test_a_corrupt_cached_copy_of_a_remote_version_is_fetched_again(tmp_path, draft_dir):
    reg = Registry(tmp_path.joinpath("reg").as_uri(), cache_dir=tmp_path / "cache")
    reg.publish(draft_dir, "v1")
    reg.local = False  # read it as an object store would be: through the local cache
    path = reg.local_path("v1")
    weights = path / "draft.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])  # the cache entry got corrupted
    assert reg.local_path("v1") == path and (path / "draft.safetensors").stat().st_size > weights.stat().st_size - 1


def test_publish_and_alias_writes_are_fsynced(tmp_path, draft_dir, monkeypatch):
    reg = Registry(tmp_path.joinpath("reg").as_uri())
    synced: list[str] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    v = reg.publish(draft_dir, "v1")
    reg.promote("v1")
    root = str(tmp_path / "reg")
    for must in (f"{root}/versions/v1/manifest.json", f"{root}/versions/v1", f"{root}/versions/v1/{v.payload}",
                 f"{root}/versions/v1/{v.payload}/draft.safetensors", f"{root}/aliases/stable.json", f"{root}/aliases"):
        assert any(s == must or s.startswith(must.replace("manifest.json", ".manifest.json"))
                   or (must.endswith("stable.json") and ".stable.json.tmp-" in s) for s in synced), must
