"""Registry: immutable versions on a pyarrow filesystem, atomic publish, aliases, digests, gc."""

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.registry import (
    DigestMismatch,
    Registry,
    RegistryError,
    VersionExists,
    VersionNotFound,
)

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def draft_dir(tiny, tmp_path_factory):
    from train.draft_model import DraftSpec, build_draft, save_draft

    spec = DraftSpec(num_layers=1)
    out = tmp_path_factory.mktemp("drafts") / "d1"
    save_draft(build_draft(tiny.model, spec), spec, out, target_ref={"spec": "tiny-random"},
               lineage={"parent": None, "records_consumed": 7}, metrics={"alpha_est": 0.4})
    return out


@pytest.fixture
def reg(tmp_path):
    return Registry((tmp_path / "reg").as_uri(), cache_dir=tmp_path / "cache")


def test_publish_get_list_and_load(reg, draft_dir, tiny):
    v = reg.publish(draft_dir)
    assert v.id == "v1" and v.lineage["records_consumed"] == 7 and v.metrics["alpha_est"] == 0.4
    assert v.tokenizer == {"spec": "tiny-random"}
    assert set(v.files) == {p.name for p in draft_dir.iterdir()}
    assert reg.publish(draft_dir).id == "v2"
    assert [x.id for x in reg.list()] == ["v1", "v2"]
    model, info = reg.load_draft("v1", tiny.model)
    ids = torch.tensor([[1, 2, 3]])
    from train.draft_model import load_draft

    ref, _ = load_draft(draft_dir, tiny.model)
    assert torch.equal(model(ids).logits, ref(ids).logits) and info["version"] == "v1"
    with pytest.raises(VersionNotFound, match="v9 does not exist"):
        reg.get("v9")
    with pytest.raises(RegistryError, match="bad version id"):
        reg.publish(draft_dir, "../escape")


def test_versions_are_immutable(reg, draft_dir):
    reg.publish(draft_dir, "cand-1")
    with pytest.raises(VersionExists, match="immutable"):
        reg.publish(draft_dir, "cand-1")


def test_object_store_path_refuses_an_existing_id(reg, draft_dir):
    """The non-local branch (no create-if-absent): check, write, read back."""
    reg.local = False
    reg.publish(draft_dir, "x")
    with pytest.raises(VersionExists):
        reg.publish(draft_dir, "x")
    assert reg.local_path("x").is_dir()  # copied into the cache dir, digests checked


def test_corrupt_file_is_refused(reg, draft_dir, tiny):
    reg.publish(draft_dir, "v1")
    weights = reg.local_path("v1") / "draft.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(DigestMismatch, match="draft.safetensors does not match its sha256"):
        reg.load_draft("v1", tiny.model)
    weights.unlink()
    with pytest.raises(DigestMismatch, match="missing"):
        reg.local_path("v1")


def test_truncated_or_foreign_manifest_means_no_version(reg, draft_dir):
    reg.publish(draft_dir, "v1")
    mpath = Path(reg.root) / "versions" / "v1" / "manifest.json"
    mpath.write_text(mpath.read_text()[:40])
    assert not reg.exists("v1") and reg.list() == []
    with pytest.raises(RegistryError, match="unreadable manifest"):
        reg.get("v1")


_KILL_CHILD = """
import os, sys, time
from pipeline.registry import Registry
real_link = os.link
def stuck(*a, **k):  # files are written; hang right before the manifest appears
    open(sys.argv[3], "w").close()
    time.sleep(600)
os.link = stuck
Registry(sys.argv[1]).publish(sys.argv[2], "v1")
"""


def test_kill_during_publish_leaves_no_version(reg, draft_dir, tmp_path):
    marker = tmp_path / "payload-written"
    child = subprocess.Popen([sys.executable, "-c", _KILL_CHILD, reg.uri, str(draft_dir), str(marker)])
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert child.poll() is None and time.monotonic() < deadline, "publisher never reached the manifest"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    finally:
        child.kill()
    vdir = Path(reg.root) / "versions" / "v1"
    assert any(p.name.startswith("payload-") for p in vdir.iterdir())  # the files got there ...
    assert not reg.exists("v1") and reg.list() == []  # ... but without a manifest there is no version
    assert reg.publish(draft_dir, "v1").id == "v1"  # the id is still free
    removed = reg.gc(keep_last=5, orphan_age_s=0)
    assert len(removed) == 1 and removed[0].startswith("v1/payload-")
    reg.local_path("v1")  # the published one is intact


def _publish_race(uri, src, barrier, out):
    barrier.wait()
    try:
        Registry(uri).publish(src, "same")
        out.put("won")
    except VersionExists:
        out.put("lost")


def test_concurrent_publish_of_one_id_has_exactly_one_winner(reg, draft_dir):
    ctx = mp.get_context("spawn")
    n = 4
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_publish_race, args=(reg.uri, str(draft_dir), barrier, out)) for _ in range(n)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert results == ["lost"] * (n - 1) + ["won"]
    reg.local_path("same")  # the winner's payload is the one the manifest names
    vdir = Path(reg.root) / "versions" / "same"
    assert len([p for p in vdir.iterdir() if p.name.startswith("payload-")]) == 1  # losers cleaned up


def test_alias_moves_promote_and_rollback(reg, draft_dir):
    for v in ("v1", "v2", "v3"):
        reg.publish(draft_dir, v)
    assert reg.aliases() == {"stable": None, "canary": None}
    reg.set_stable("v1")
    reg.set_canary("v2", 0.1)
    assert reg.alias("canary")["weight"] == 0.1
    reg.set_canary("v2", 0.5)
    assert reg.rollback() == {"dropped_canary": "v2", "stable": "v1"}
    assert reg.alias("canary") is None and reg.alias("stable")["version"] == "v1"
    reg.set_canary("v3", 0.1)
    reg.promote("v3")
    assert reg.alias("stable")["version"] == "v3" and reg.alias("stable")["previous"] == "v1"
    assert reg.alias("canary") is None
    assert reg.rollback() == {"stable": "v1", "from": "v3"}
    with pytest.raises(RegistryError, match="nothing to roll back"):
        reg.rollback()
    with pytest.raises(VersionNotFound):
        reg.set_canary("v7", 0.1)
    with pytest.raises(RegistryError, match="weight"):
        reg.set_canary("v2", 0.0)
    with pytest.raises(RegistryError, match="unknown alias"):
        reg.alias("beta")
    aliases = sorted(p.name for p in (Path(reg.root) / "aliases").iterdir())
    assert aliases == ["stable.json"]  # no temp files left behind


def test_gc_keeps_aliased_and_last_n(reg, draft_dir):
    for i in range(1, 7):
        reg.publish(draft_dir, f"v{i}")
    reg.set_stable("v1")
    reg.set_stable("v2")  # previous = v1
    reg.set_canary("v3", 0.1)
    assert sorted(reg.gc(keep_last=2)) == ["v4"]
    assert [v.id for v in reg.list()] == ["v1", "v2", "v3", "v5", "v6"]


def test_audit_log_round_trip(reg):
    reg.audit({"version": "v2", "action": "promote", "evidence": {"n": 3}})
    reg.audit({"version": "v3", "action": "rollback"})
    log = reg.audit_log()
    assert [e["action"] for e in log] == ["promote", "rollback"] and log[0]["evidence"] == {"n": 3}


def test_bad_uri_is_a_clear_error(tmp_path):
    with pytest.raises(RegistryError, match="not a filesystem pyarrow can open"):
        Registry("nosuch://bucket/x")


def test_registry_cli(tmp_path, draft_dir):
    env = {**os.environ, "OSD_STATE_DIR": str(tmp_path / "state")}

    def osd(*args, ok=True):
        r = subprocess.run([sys.executable, "-m", "pipeline.cli", "registry", *args], env=env,
                           capture_output=True, text=True, timeout=120)
        assert (r.returncode == 0) == ok, r.stderr
        return r

    assert "v1" in osd("publish", str(draft_dir)).stdout
    osd("publish", str(draft_dir), "--version", "v2")
    osd("promote", "v1")
    osd("promote", "v2")
    listing = json.loads(osd("list", "--json").stdout)
    assert [v["version"] for v in listing] == ["v1", "v2"] and listing[1]["aliases"] == ["stable"]
    shown = json.loads(osd("show", "v1").stdout)
    assert shown["lineage"]["records_consumed"] == 7 and "draft.safetensors" in shown["files"]
    assert "stable" in osd("rollback").stdout
    r = osd("show", "v9", ok=False)
    assert r.returncode == 2 and "v9 does not exist" in r.stderr
    assert "removed 0" in osd("gc", "--keep-last", "1").stdout


def test_up_needs_a_stable_draft_or_a_warm_start(tmp_path, draft_dir):
    from pipeline.config import load_config
    from pipeline.up import UpError, ensure_stable

    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    with pytest.raises(UpError, match="osd draft init"):
        ensure_stable(cfg)
    assert ensure_stable(cfg, warm_start_dir=draft_dir) == "v1"
    reg = Registry.from_config(cfg)
    assert reg.alias("stable")["version"] == "v1" and reg.alias("stable")["reason"] == "warm start"
    assert ensure_stable(cfg) == "v1" and len(reg.list()) == 1  # idempotent
