"""Every target has an identity (infra.target.target_identity); every draft records it, and a
draft made for another target is refused by `osd serve --draft DIR` and `osd registry publish`
(hot swap: tests/test_hot_swap.py; the registry: tests/test_registry.py)."""

import hashlib
import json

import pytest

from infra.config import ModelConfig
from infra.target import MANIFEST, TargetError, identify_target, load_target, target_identity, write_manifest

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def tiny1():
    return load_target("tiny-random:1", progress=False)


@pytest.fixture(scope="module")
def draft_for_tiny1(tiny1, tmp_path_factory):
    from infra.drafts.layer import DraftSpec, build_draft, save_draft, target_ref

    spec = DraftSpec(num_layers=1)
    out = tmp_path_factory.mktemp("drafts") / "for-tiny1"
    return save_draft(build_draft(tiny1.model, spec), spec, out, target_ref=target_ref(tiny1))


def test_in_process_targets_same_spec_matches_other_seed_differs_dtype_does_not(tiny, tiny1):
    assert target_identity(tiny) == identify_target("tiny-random:0") == identify_target("tiny-random")
    assert target_identity(tiny1) == identify_target("tiny-random:1", model=tiny1.model)
    assert target_identity(tiny1) != target_identity(tiny)
    # A float32 trainer and a bfloat16 server of the same weights share one target, as for a directory.
    assert identify_target("tiny-random:1", ModelConfig(dtype="bfloat16")) == target_identity(tiny1)


def test_a_cached_directory_is_named_by_its_manifest(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    bare = identify_target(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    assert identify_target(str(tmp_path)) != bare  # no manifest: the files themselves are hashed
    write_manifest(tmp_path, {})
    assert identify_target(str(tmp_path)) == hashlib.sha256((tmp_path / MANIFEST).read_bytes()).hexdigest()


def test_an_unknown_target_is_a_target_error(tmp_path):
    with pytest.raises(TargetError, match="unknown target"):
        identify_target(str(tmp_path / "nope"))
    with pytest.raises(TargetError, match="tiny-random:SEED"):
        identify_target("tiny-random:x")


def test_every_saved_draft_records_the_identity(draft_for_tiny1, tiny1):
    info = json.loads((draft_for_tiny1 / "draft.json").read_text())
    assert info["target_ref"] == {"spec": "tiny-random:1", "sha256": target_identity(tiny1)}


def _osd(monkeypatch, capsys, tmp_path, target, *argv):
    from pipeline.cli import main

    monkeypatch.setenv("OSD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("OSD_MODEL__TARGET", target)
    monkeypatch.delenv("OSD_STREAM__REDIS_URL", raising=False)
    rc = main(list(argv))
    return rc, capsys.readouterr()


def test_registry_publish_refuses_a_draft_for_another_target(draft_for_tiny1, tiny1, monkeypatch, capsys,
                                                             tmp_path):
    rc, out = _osd(monkeypatch, capsys, tmp_path, "tiny-random:2", "registry", "publish", str(draft_for_tiny1))
    errors = [ln for ln in out.err.splitlines() if ln.startswith("osd: error")]
    assert rc == 2 and len(errors) == 1, out.err
    assert "made for target 'tiny-random:1'" in errors[0] and target_identity(tiny1)[:12] in errors[0]
    assert identify_target("tiny-random:2")[:12] in errors[0]
    rc, out = _osd(monkeypatch, capsys, tmp_path, "tiny-random:1", "registry", "publish", str(draft_for_tiny1))
    assert rc == 0 and "published v1" in out.out


def test_serve_refuses_a_draft_for_another_target_before_starting_anything(draft_for_tiny1, tiny1, monkeypatch,
                                                                         capsys, tmp_path):
    rc, out = _osd(monkeypatch, capsys, tmp_path, "tiny-random:2", "serve", "--draft", str(draft_for_tiny1))
    errors = [ln for ln in out.err.splitlines() if ln.startswith("osd: error")]
    assert rc == 2 and len(errors) == 1, out.err
    assert errors[0].startswith(f"osd: error: serve.draft '{draft_for_tiny1}'")
    assert "made for target 'tiny-random:1'" in errors[0] and target_identity(tiny1)[:12] in errors[0]
    assert not (tmp_path / "state" / "redis").exists()  # failed in preflight, before the stack


def test_preflight_accepts_the_draft_for_its_own_target(draft_for_tiny1):
    from infra.config import load_config
    from pipeline.stack.launch import preflight

    cfg = load_config(environ={}, overrides={"model": {"target": "tiny-random:1"},
                                             "serve": {"draft": str(draft_for_tiny1)}})
    preflight(cfg)  # raises LaunchError otherwise
