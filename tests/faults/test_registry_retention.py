"""The registry stays within its retention however fast the trainer exports: gc ran only on the
rollout controller's final decisions, so while a canary ran (or the controller was down) every
export added a version; the soak (pipeline/soak.py) counted 30 against gc's 19. The trainer
now collects after each publish."""

import shutil
from types import SimpleNamespace

import pytest

from infra.config import load_config
from infra.registry import AUDIT_PROTECT, Registry
from train.online.export import Exporter

pytestmark = pytest.mark.pure


def _exporter(cfg, tiny, draft_dir, run_dir):
    """The trainer's exporter, publishing every candidate (the bootstrap gate's way); its family
    saves a copy of draft_dir."""
    fam = SimpleNamespace(name="layer", rebuild=lambda weights: None,
                          save=lambda draft, out, **kw: shutil.copytree(draft_dir, out))
    e = Exporter(cfg, fam, tiny.model, run_dir, "v1")
    e._bootstrap = lambda *a: ({"passed": False, "reason": "not scored here"}, [])  # evidence, scores
    return e


def test_versions_stay_within_retention_while_no_decision_is_taken(tmp_path, tiny, draft_dir):
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path), "registry": {"keep_last": 1},
                                             "train": {"gate": {"method": "bootstrap"}}})
    reg = Registry.from_config(cfg)
    reg.publish(draft_dir, "v1")
    reg.promote("v1")
    e = _exporter(cfg, tiny, draft_dir, tmp_path / "train" / "t")
    for i in range(1, 21):  # exports, and no controller deciding on any of them
        e.export({}, [0.5], 12, version=f"t-v{i:04d}", held_out=[], trained_prompts=set(), records_total=12 * i,
                 world_size=1)
    kept = cfg.registry.keep_last + 3 + AUDIT_PROTECT  # newest, aliased (stable, previous, canary), audited
    ids = [v.id for v in reg.list()]
    assert len(ids) <= kept, f"{len(ids)} versions kept, retention {kept}"
    assert "v1" in ids and ids[-1] == "t-v0020"  # stable kept, the newest candidate kept


def test_the_controller_leaves_retention_to_the_trainer(tmp_path, draft_dir):
    """One owner of registry gc: a decision by the rollout controller deletes nothing; the
    trainer's next publish collects what the decision freed."""
    from pipeline.rollout.controller import CanaryController

    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path), "registry": {"keep_last": 1}})
    reg = Registry.from_config(cfg)
    for v in ("v1", "v2", "v3"):
        reg.publish(draft_dir, v)
    c = object.__new__(CanaryController)
    c.cfg, c.registry, c.decisions = cfg, reg, []
    c.metrics = SimpleNamespace(decision=lambda *a: None)
    c._record("rollback", "v2", "worse than stable")
    assert [v.id for v in reg.list()] == ["v1", "v2", "v3"]
