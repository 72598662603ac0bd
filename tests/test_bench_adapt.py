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


def test_each_head_variant_changes_only_its_own_setting():
    from pipeline.bench.adapt_head import HEAD_VARIANTS, head_variant_config

    cfg = load_config()
    assert head_variant_config(cfg, "base").train == cfg.train
    assert cfg.train.head_loss_rows == "outputs"
    assert head_variant_config(cfg, "all_rows").train == cfg.train.model_copy(update={"head_loss_rows": "all"})
    assert head_variant_config(cfg, "low_lr").train == cfg.train.model_copy(update={"lr": cfg.train.lr / 3})
    assert head_variant_config(cfg, "high_lr").train == cfg.train.model_copy(update={"lr": cfg.train.lr * 3})
    more = head_variant_config(cfg.model_copy(update={"train": cfg.train.model_copy(update={"replay_steps": 3})}),
                               "more_replay")
    assert more.train.replay_steps == 6 and more.train.lr == cfg.train.lr
    demo = cfg.model_copy(update={"train": cfg.train.model_copy(update={"replay_steps": 1})})
    assert head_variant_config(demo, "three_replays").train == demo.train.model_copy(update={"replay_steps": 3})
    assert head_variant_config(demo, "no_replay").train == demo.train.model_copy(update={"replay_steps": 0})
    assert set(HEAD_VARIANTS) == {"base", "all_rows", "low_lr", "high_lr", "more_replay", "no_replay",
                                  "three_replays", "ce", "tv", "ce_tv"}
    for name, loss in (("ce", "ce"), ("tv", "tv"), ("ce_tv", "ce+tv")):
        assert head_variant_config(cfg, name).train == cfg.train.model_copy(update={"head_loss": loss})


def test_a_variant_of_the_other_family_is_a_users_error(capsys):
    """`osd bench adapt --variants anchor` (a layer variant; the head is the default family) exits 2
    with the head's variants named, before loading anything."""
    from pipeline.cli import main

    assert main(["bench", "adapt", "--variants", "anchor", "--json", ""]) == 2
    assert "unknown head variant 'anchor'" in capsys.readouterr().err
