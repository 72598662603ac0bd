"""Warm replay's data (`osd bench adapt --variants warm_replay`): the warm start's teacher
records, read from the cache `osd draft init` left, never generated."""

import pytest

from infra.config import OSDConfig
from infra.target import load_target
from train.teacher.sets import cached_warm_records, teacher_records, warm_prompts

pytestmark = pytest.mark.pure


def test_cached_warm_records_reads_the_warm_starts_cache_and_never_builds(tmp_path):
    cfg = OSDConfig.model_validate({"state_dir": str(tmp_path / "state"), "model": {"target": "tiny-random"},
                                    "train": {"warm_prompts": 3, "warm_max_new_tokens": 4}})
    loaded = load_target("tiny-random", progress=False)
    assert cached_warm_records(cfg, loaded) == []  # nothing cached: nothing, and nothing built
    assert not (tmp_path / "state").exists()  # a read: no state dir, no teacher cache, not even empty dirs
    built = teacher_records(cfg, loaded, warm_prompts(cfg, 3), progress=False)
    got = cached_warm_records(cfg, loaded)
    assert [r.request_id for r in got] == [r.request_id for r in built] and len(got) == 3
    # Another state dir (the demo's) finds them when given the folder.
    other = cfg.model_copy(update={"state_dir": str(tmp_path / "demo")})
    assert len(cached_warm_records(other, loaded, tmp_path / "state" / "teacher")) == 3
    moved = cfg.model_copy(update={"state_dir": str(tmp_path / "demo")})
    assert cached_warm_records(moved, loaded) == []
