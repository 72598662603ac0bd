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

from infra.registry import (
    DigestMismatch,
    Registry,
    RegistryError,
    VersionExists,
    VersionNotFound,
)

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def draft_dir(tiny, tmp_path_factory):
    from infra.drafts.layer import DraftSpec, build_draft, save_draft, target_ref

    spec = DraftSpec(num_layers=1)
    out = tmp_path_factory.mktemp("drafts") / "d1"
    save_draft(build_draft(tiny.model, spec), spec, out, target_ref=target_ref(tiny),
               lineage={"parent": None, "records_consumed": 7}, metrics={"alpha_est": 0.4})
    return out


@pytest.fixture
def reg(tmp_path):
    return Registry((tmp_path / "reg").as_uri(), cache_dir=tmp_path / "cache")


def test_publish_get_list_and_load(reg, draft_dir, tiny):
    v = reg.publish(draft_dir)
    assert v.id == "v1" and v.lineage["records_consumed"] == 7 and v.metrics["alpha_est"] == 0.4
    assert v.target["spec"] == "tiny-random" and len(v.target["sha256"]) == 64
    assert set(v.files) == {p.name for p in draft_dir.iterdir()}
    assert reg.publish(draft_dir).id == "v2"
    assert [x.id for x in reg.list()] == ["v1", "v2"]
    model, info = reg.load_draft("v1", tiny.model)
    ids = torch.tensor([[1, 2, 3]])
    from infra.drafts.layer import load_draft

    ref, _ = load_draft(draft_dir, tiny.model)
    assert torch.equal(model(ids).logits, ref(ids).logits) and info["version"] == "v1"
    # the version's own directory, as the demo's report names it, loads as the draft it holds
    by_dir, _ = load_draft(Path(reg.uri.removeprefix("file://")) / "versions" / "v1", tiny.model)
    assert torch.equal(by_dir(ids).logits, ref(ids).logits)
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
from infra.registry import Registry
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
    # the orphan payload, and the manifest's temp file the kill left (issue 44: litter is collected)
    assert sorted(r.split("/")[-1].split("-")[0] for r in removed) == [".manifest.json.payload", "payload"]
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
    # publish compares the draft with the configured target: the one draft_dir was made for
    env = {**os.environ, "OSD_STATE_DIR": str(tmp_path / "state"), "OSD_MODEL__TARGET": "tiny-random"}

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
    from infra.config import load_config
    from pipeline.stack.up import UpError, ensure_stable

    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    with pytest.raises(UpError, match="osd draft init"):
        ensure_stable(cfg)
    assert ensure_stable(cfg, warm_start_dir=draft_dir) == "v1"
    reg = Registry.from_config(cfg)
    assert reg.alias("stable")["version"] == "v1" and reg.alias("stable")["reason"] == "warm start"
    assert ensure_stable(cfg) == "v1" and len(reg.list()) == 1  # idempotent


# -- issue 18: what the registry accepts, manual decisions, gc against alias writes ----------

def _copy_and_break(draft_dir, dest, edit, remanifest=True):
    """A copy of the draft with one defect; its osd-manifest.json rewritten to match unless
    remanifest=False, so the defect under test is the only one."""
    import shutil

    from infra.target import write_manifest

    shutil.copytree(draft_dir, dest)
    edit(dest)
    if remanifest:
        write_manifest(dest, {"kind": "osd-draft"})
    return dest


def _edit_json(name, change):
    def edit(d):
        body = json.loads((d / name).read_text())
        change(body)
        (d / name).write_text(json.dumps(body))
    return edit


def _safetensors_without_one_tensor(d):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "draft.safetensors"))
    tensors.pop(sorted(tensors)[0])
    save_file(tensors, str(d / "draft.safetensors"))


_BROKEN = {
    "random bytes as weights": (lambda d: (d / "draft.safetensors").write_bytes(os.urandom(4096)),
                                True, "draft.safetensors is not a safetensors file"),
    "truncated weights": (lambda d: (d / "draft.safetensors").write_bytes((d / "draft.safetensors").read_bytes()[:-8]),
                          True, "tensor data does not match the header"),
    "a tensor missing": (_safetensors_without_one_tensor, True, "differ from the"),
    "corrupt draft.json": (lambda d: (d / "draft.json").write_text('{"format": 1, "kind": '), True,
                           "draft.json is not valid JSON"),
    "draft.json not an object": (lambda d: (d / "draft.json").write_text("[1, 2]"), True,
                                 "draft.json is not a JSON object"),
    "draft.json without trainable_tensors": (_edit_json("draft.json", lambda b: b.pop("trainable_tensors")), True,
                                             "lacks a required field"),
    "draft.json with a bad spec": (_edit_json("draft.json", lambda b: b["spec"].update(num_layers=0)), True,
                                   "lacks a required field or has a bad one"),
    "wrong kind": (_edit_json("draft.json", lambda b: b.update(kind="something")), True, "kind 'something'"),
    "config.json that does not fit the weights": (
        _edit_json("config.json", lambda b: b.update(intermediate_size=b["intermediate_size"] + 8)), True,
        "config.json implies"),
    "not a family drafts are made for": (_edit_json("config.json", lambda b: b.update(model_type="gpt2")), True,
                           "drafts are models of llama"),
    "no osd-manifest.json": (lambda d: (d / "osd-manifest.json").unlink(), False, "osd-manifest.json missing"),
    "edited after its manifest": (lambda d: (d / "draft.json").write_text((d / "draft.json").read_text() + " "),
                                  False, "changed since its osd-manifest.json"),
}


@pytest.mark.parametrize("case", sorted(_BROKEN))
def test_publish_refuses_a_draft_serving_could_not_load(reg, draft_dir, tmp_path, case):
    edit, remanifest, message = _BROKEN[case]
    src = _copy_and_break(draft_dir, tmp_path / "broken", edit, remanifest)
    with pytest.raises(RegistryError, match=message) as err:
        reg.publish(src, "v1")
    assert "\n" not in str(err.value) and str(src) in str(err.value)
    assert reg.list() == [] and not reg.exists("v1")
    payloads = [p for p in (Path(reg.root) / "versions").rglob("payload-*")]
    assert payloads == []  # nothing half-published is left for gc
    assert reg.publish(draft_dir, "v1").id == "v1"  # and the id is still free


def test_publish_refuses_a_directory_of_random_bytes(reg, tmp_path):
    src = tmp_path / "junk"
    src.mkdir()
    (src / "blob.bin").write_bytes(os.urandom(1024))
    with pytest.raises(RegistryError, match="not a saved draft: draft.json, config.json, draft.safetensors"):
        reg.publish(src)
    assert reg.list() == []


def test_loading_a_version_with_a_corrupt_draft_json_is_one_registry_error(reg, draft_dir, tiny):
    """A version published before publish checked drafts: its digests match, its draft.json is junk."""
    import hashlib

    reg.publish(draft_dir, "v1")
    payload = reg.local_path("v1")
    (payload / "draft.json").write_text("{not json")
    mpath = Path(reg.root) / "versions" / "v1" / "manifest.json"
    body = json.loads(mpath.read_text())
    body["files"]["draft.json"] = {"sha256": hashlib.sha256(b"{not json").hexdigest(), "size": 9}
    mpath.write_text(json.dumps(body))
    with pytest.raises(RegistryError, match="version v1 cannot be loaded: draft.json is not valid JSON") as err:
        reg.load_draft("v1", tiny.model)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("bad", ["v1\n", "v1\r\n", "v1 ", "\nv1"])
def test_version_id_with_a_trailing_newline_is_refused(reg, draft_dir, bad):
    with pytest.raises(RegistryError, match="bad version id"):
        reg.publish(draft_dir, bad)
    with pytest.raises(RegistryError, match="bad version id"):
        reg.get(bad)
    assert reg.list() == []


@pytest.mark.parametrize("keep_last", [-1, 0, 1.5, True])
def test_gc_refuses_a_keep_last_below_one(reg, draft_dir, keep_last):
    for v in ("v1", "v2", "v3"):
        reg.publish(draft_dir, v)
    with pytest.raises(RegistryError, match="keep_last must be a whole number >= 1"):
        reg.gc(keep_last)
    assert [v.id for v in reg.list()] == ["v1", "v2", "v3"]  # nothing removed


def test_cli_gc_refuses_a_negative_keep_last_and_rollback_is_audited(tmp_path, draft_dir):
    env = {**os.environ, "OSD_STATE_DIR": str(tmp_path / "state")}
    from infra.config import load_config

    reg = Registry.from_config(load_config(environ={}, overrides={"state_dir": str(tmp_path / "state")}))
    for v in ("v1", "v2"):
        reg.publish(draft_dir, v)
    reg.promote("v1")
    reg.set_canary("v2", 0.1)

    def osd(*args):
        return subprocess.run([sys.executable, "-m", "pipeline.cli", "registry", *args], env=env,
                              capture_output=True, text=True, timeout=120)

    r = osd("gc", "--keep-last", "-1")
    assert r.returncode == 2 and "keep_last must be a whole number >= 1, got -1" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and [v.id for v in reg.list()] == ["v1", "v2"]
    r = osd("rollback")
    assert r.returncode == 0 and "dropped canary v2" in r.stdout
    log = reg.audit_log()
    assert [(e["action"], e["version"], e["manual"]) for e in log] == [("rollback", "v2", True)]
    # a person can make it the canary again (the controller judges a canary it finds); recorded too
    r = osd("canary", "v2", "--weight", "0")
    assert r.returncode == 2 and "canary weight must be in (0, 1]" in r.stderr and reg.alias("canary") is None
    assert osd("canary", "v2", "--weight", "0.2").returncode == 0
    assert reg.alias("canary")["version"] == "v2" and reg.alias("canary")["weight"] == 0.2
    assert [(e["action"], e["version"]) for e in reg.audit_log()] == [("rollback", "v2"), ("canary", "v2")]


def test_rollback_of_stable_is_audited_with_the_version_it_undid(reg, draft_dir):
    for v in ("v1", "v2"):
        reg.publish(draft_dir, v)
    reg.promote("v1")
    reg.promote("v2")
    assert reg.rollback("bad numbers") == {"stable": "v1", "from": "v2"}
    (entry,) = reg.audit_log()
    assert (entry["action"], entry["version"], entry["reason"], entry["manual"]) == ("rollback", "v2", "bad numbers", True)
    with pytest.raises(RegistryError, match="nothing to roll back"):
        reg.rollback()
    assert len(reg.audit_log()) == 1  # a refused rollback records nothing


def test_alias_moves_can_be_compare_and_set(reg, draft_dir):
    from infra.registry import AliasMoved

    for v in ("v1", "v2", "v3"):
        reg.publish(draft_dir, v)
    reg.promote("v1")
    reg.set_canary("v2", 0.1, expect=None)
    with pytest.raises(AliasMoved, match="names v2, not nothing"):
        reg.set_canary("v3", 0.1, expect=None)
    with pytest.raises(AliasMoved, match="names v2, not v3"):
        reg.promote("v3", expect_canary="v3")
    reg.clear_canary()
    with pytest.raises(AliasMoved, match="names nothing, not v2"):
        reg.set_canary("v2", 0.5, expect="v2")
    assert reg.alias("canary") is None and reg.alias("stable")["version"] == "v1"


def test_gc_keeps_versions_the_newest_audit_entries_name(reg, draft_dir):
    for i in range(1, 6):
        reg.publish(draft_dir, f"v{i}")
    reg.promote("v1")
    reg.audit({"action": "rollback", "version": "v2"})  # just rolled back: a person may re-promote it
    assert sorted(reg.gc(keep_last=1)) == ["v3", "v4"]
    assert [v.id for v in reg.list()] == ["v1", "v2", "v5"]


def test_gc_and_promote_racing_never_leave_an_alias_on_a_deleted_version(reg, draft_dir):
    """gc has listed the versions and decided v2 may go; a promote of v2 (another process: its own
    Registry object) comes in before gc deletes it. Under the lock it waits, then finds v2 gone."""
    import threading

    for v in ("v1", "v2", "v3"):
        reg.publish(draft_dir, v)
    reg.promote("v1")
    other = Registry(reg.uri, cache_dir=reg.cache_dir)
    outcome = {}

    def promote_v2():
        try:
            outcome["stable"] = other.promote("v2")["version"]
        except VersionNotFound as e:
            outcome["error"] = str(e)

    real_list = reg.list
    racer = threading.Thread(target=promote_v2)

    def list_then_race():
        versions = real_list()
        racer.start()
        racer.join(timeout=2.0)  # without the lock the promote completes here, before the deletes
        return versions

    reg.list = list_then_race
    removed = reg.gc(keep_last=1)
    racer.join(timeout=60)
    assert not racer.is_alive()
    assert removed == ["v2"] and "v2 does not exist" in outcome.get("error", "")
    stable = reg.alias("stable")["version"]
    assert stable == "v1" and reg.exists(stable)


def test_promote_first_then_gc_keeps_the_promoted_version(reg, draft_dir):
    for v in ("v1", "v2", "v3"):
        reg.publish(draft_dir, v)
    reg.promote("v1")
    Registry(reg.uri, cache_dir=reg.cache_dir).promote("v2")
    assert reg.gc(keep_last=1) == []  # v1 is stable's previous, v2 stable, v3 the newest
    assert all(reg.exists(v) for v in ("v1", "v2", "v3"))


# ---------------------------------------------------------------- the target a version was made for

def test_manifest_records_the_target_and_old_manifests_still_load(reg, draft_dir, tiny):
    from infra.target import target_identity

    reg.publish(draft_dir, "v1")
    mpath = Path(reg.root) / "versions" / "v1" / "manifest.json"
    body = json.loads(mpath.read_text())
    assert body["target"] == {"spec": "tiny-random", "sha256": target_identity(tiny)} and "tokenizer" not in body
    # A manifest written before the field was renamed
    body["tokenizer"] = body.pop("target")
    mpath.write_text(json.dumps(body))
    assert reg.get("v1").target["sha256"] == target_identity(tiny)
    reg.load_draft("v1", tiny.model, expect_target_sha256=target_identity(tiny))


def test_a_version_for_another_target_is_refused_before_any_file_is_hashed(reg, draft_dir, tiny, monkeypatch):
    import infra.target

    reg.publish(draft_dir, "v1")
    hashed = []
    real = infra.target.sha256_file
    monkeypatch.setattr(infra.target, "sha256_file", lambda p, *a, **k: hashed.append(p.name) or real(p, *a, **k))
    with pytest.raises(RegistryError, match=r"version v1 cannot be loaded: it was made for target 'tiny-random' "
                                            r"\(sha256 \w{12}…\), not this one \(sha256 abababababab…\)"):
        reg.load_draft("v1", tiny.model, expect_target_sha256="ab" * 32)
    assert hashed == []


def test_loading_a_version_hashes_each_file_once(reg, draft_dir, tiny, monkeypatch):
    import infra.target

    v = reg.publish(draft_dir, "v1")
    hashed = []
    real = infra.target.sha256_file
    monkeypatch.setattr(infra.target, "sha256_file", lambda p, *a, **k: hashed.append(p.name) or real(p, *a, **k))
    reg.load_draft("v1", tiny.model)
    assert sorted(hashed) == sorted(v.files)


def test_publish_refuses_a_draft_for_another_target(reg, draft_dir):
    with pytest.raises(RegistryError, match=r"cannot publish .*d1: the draft was made for target 'tiny-random' "
                                            r"\(sha256 \w{12}…\), not this one \(sha256 abababababab…\)"):
        reg.publish(draft_dir, "v1", expect_target_sha256="ab" * 32)
    assert reg.list() == []
