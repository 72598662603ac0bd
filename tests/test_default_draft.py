"""Issue 12, item 5: the warm-started head is the default draft of `osd serve` (serve.draft:
auto), `osd up` (the draft it publishes as v1) and `osd draft init` (the family it builds)."""

import json

import pytest

from infra.config import OSDConfig, load_config
from infra.drafts.spec import warm_start_path, warm_started_draft
from serve.spec_decode.specs import AUTO_DRAFT, resolve_auto

pytestmark = pytest.mark.pure


def config(state_dir, **serve) -> OSDConfig:
    return load_config(environ={}, overrides={"state_dir": str(state_dir), "serve": serve})


def save_head_at(tiny, path):
    from infra.drafts.head import build_head, save_head
    from infra.drafts.spec import DraftSpec

    return save_head(build_head(tiny.model, DraftSpec(family="head")), path, target_ref={"spec": "tiny-random"})


def save_layer_at(draft_dir, path):
    import shutil

    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(draft_dir, path)
    return path


def test_auto_is_the_default_and_is_the_suffix_draft_with_the_way_to_the_head(tmp_path):
    assert OSDConfig().serve.draft == "auto"
    spec, why = resolve_auto(config(tmp_path))
    assert spec == AUTO_DRAFT == "suffix"
    assert "osd draft init --family head" in why and "--draft head+suffix" in why


def test_auto_stays_the_suffix_draft_and_names_how_to_serve_a_warm_start(tmp_path, tiny, draft_dir):
    """Chosen by measurement (docs/benchmarks.md, "The suffix draft"): the suffix draft tied or beat the
    warm-started head beside it, so auto serves it and says how to serve the warm start."""
    cfg = config(tmp_path)
    layer = save_layer_at(draft_dir, warm_start_path(cfg, "layer"))
    spec, why = resolve_auto(cfg)
    assert spec == "suffix" and f"--draft {layer}" in why
    head = save_head_at(tiny, warm_start_path(cfg, "head"))
    spec, why = resolve_auto(cfg)
    assert spec == "suffix" and str(head) in why and "--draft head+suffix" in why
    named = config(tmp_path, draft="head+suffix")
    assert resolve_auto(named)[0] == f"{head}+suffix"
    assert json.loads((head / "draft.json").read_text())["spec"]["family"] == "head"


def test_a_warm_start_without_its_manifest_is_not_served(tmp_path, tiny, draft_dir):
    """A head warm start still running (or cut off) has no manifest yet: auto skips it."""
    from infra.target import MANIFEST

    cfg = config(tmp_path)
    head = save_head_at(tiny, warm_start_path(cfg, "head"))
    (head / MANIFEST).unlink()
    assert warm_started_draft(cfg) is None
    layer = save_layer_at(draft_dir, warm_start_path(cfg, "layer"))
    assert warm_started_draft(cfg) == layer


def test_an_explicit_draft_is_left_alone(tmp_path, tiny):
    cfg = config(tmp_path, draft="truncate:1")
    save_head_at(tiny, warm_start_path(cfg, "head"))
    assert resolve_auto(cfg)[0] == "truncate:1"
    assert resolve_auto(config(tmp_path, draft="registry"))[0] == "registry"


def test_osd_serve_resolves_auto_once_before_the_replicas_start(tmp_path, tiny, capsys):
    from pipeline.stack.launch import with_draft_resolved

    cfg = config(tmp_path)
    head = save_head_at(tiny, warm_start_path(cfg, "head"))
    got = with_draft_resolved(cfg)
    assert got.serve.draft == "suffix" and f"the warm-started draft {head}" in capsys.readouterr().err
    assert with_draft_resolved(got) is got  # nothing left to resolve


def test_osd_up_publishes_the_head_as_v1_when_both_warm_starts_exist(tmp_path, tiny, draft_dir):
    from infra.registry import Registry
    from pipeline.stack.up import ensure_stable

    cfg = config(tmp_path)
    save_layer_at(draft_dir, warm_start_path(cfg, "layer"))
    save_head_at(tiny, warm_start_path(cfg, "head"))
    assert ensure_stable(cfg) == "v1"
    v1 = Registry.from_config(cfg).local_path("v1")
    assert json.loads((v1 / "draft.json").read_text())["spec"]["family"] == "head"


def test_osd_up_without_any_warm_start_names_both_places_and_the_command(tmp_path):
    from pipeline.stack.up import UpError, ensure_stable

    cfg = config(tmp_path)
    with pytest.raises(UpError) as e:
        ensure_stable(cfg)
    msg = str(e.value)
    assert str(warm_start_path(cfg, "head")) in msg and str(warm_start_path(cfg, "layer")) in msg
    assert "osd draft init" in msg and "--family layer" in msg


def test_osd_draft_init_builds_the_head_unless_told_layer():
    from pipeline.cli import build_parser

    p = build_parser()
    assert p.parse_args(["draft", "init"]).family == "head"
    assert p.parse_args(["draft", "init", "--family", "layer"]).family == "layer"
