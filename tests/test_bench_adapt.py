"""`osd bench adapt`'s variants: each changes only its own training setting."""

import pytest

from infra.config import load_config
from pipeline.bench.adapt import VARIANTS, variant_config

pytestmark = pytest.mark.pure


def test_each_variant_changes_only_its_own_setting():
    cfg = load_config()
    base = variant_config(cfg, "base")
    assert base.warm_replay_fraction == 0 and base.anchor_kl == 0 and base.cfg.train.lr == cfg.train.lr
    assert variant_config(cfg, "low_lr").cfg.train.lr == pytest.approx(cfg.train.lr / 3)
    assert variant_config(cfg, "warm_replay").warm_replay_fraction == 0.5
    assert variant_config(cfg, "anchor").anchor_kl > 0
    for v in VARIANTS:
        t = variant_config(cfg, v).cfg.train
        assert t.replay_steps == cfg.train.replay_steps and t.held_out_every == cfg.train.held_out_every


def test_an_unknown_variant_is_refused_before_any_work():
    with pytest.raises(ValueError, match="unknown variant"):
        variant_config(load_config(), "bigger_lr")
