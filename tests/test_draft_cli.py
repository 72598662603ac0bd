"""`osd draft init --budget-minutes` and `osd draft vocab-study`: flags reach the config, and
bad values are refused before any model loads."""

import pytest

from infra.config import OSDConfig
from pipeline.cli import build_parser, main
from pipeline.cli.draft import draft_init_config

pytestmark = pytest.mark.pure


def test_budget_minutes_reaches_the_config_for_either_family(monkeypatch):
    monkeypatch.delenv("OSD_CONFIG", raising=False)
    for family, epochs_field in (("head", "head_warm_epochs"), ("layer", "warm_epochs")):
        args = build_parser().parse_args(["draft", "init", "--family", family, "--budget-minutes", "2.5",
                                          "--epochs", "3"])
        cfg = draft_init_config(OSDConfig(), args).for_warm_start(family)
        assert cfg.train.warm_budget_minutes == 2.5 and getattr(cfg.train, epochs_field) == 3
    plain = build_parser().parse_args(["draft", "init", "--family", "layer"])
    assert draft_init_config(OSDConfig(), plain).train.warm_budget_minutes is None  # the layer's: no budget
    head = draft_init_config(OSDConfig(), build_parser().parse_args(["draft", "init"]))
    assert head.for_warm_start("head").train.warm_budget_minutes == 12  # the head's: 12 minutes of answers


@pytest.mark.parametrize("value", ["0", "-1", "abc", "inf"])
def test_a_bad_budget_is_refused_by_the_parser(value, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["draft", "init", "--budget-minutes", value])
    assert e.value.code == 2 and "--budget-minutes" in capsys.readouterr().err


def test_a_bad_budget_in_the_config_is_refused_by_name():
    with pytest.raises(ValueError, match="warm_budget_minutes"):
        OSDConfig.model_validate({"train": {"warm_budget_minutes": 0}})
    with pytest.raises(ValueError, match="warm_prompts"):
        OSDConfig.model_validate({"train": {"warm_prompts": 0}})
    from infra.config import RetiredSettingWarning

    with pytest.warns(RetiredSettingWarning, match="head_vocab_source"):  # retired: ignored, named
        OSDConfig.model_validate({"train": {"head_vocab_source": "sharegpt"}})


def test_vocab_study_refuses_a_bad_eval_file_before_loading_anything(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("OSD_STATE_DIR", str(tmp_path))
    assert main(["draft", "vocab-study", "--eval-file", "no-equals-sign"]) == 2
    assert "NAME=PATH" in capsys.readouterr().err


def test_the_head_answers_its_own_prompts_and_the_layer_draft_keeps_warm_prompts(monkeypatch):
    monkeypatch.delenv("OSD_CONFIG", raising=False)
    flags = ["--prompts", "7", "--max-new-tokens", "9", "--turns", "first"]
    head = draft_init_config(OSDConfig(), build_parser().parse_args(["draft", "init", *flags]))
    assert (head.train.head_warm_prompts, head.train.head_warm_max_new_tokens, head.train.head_warm_turns) == \
        (7, 9, "first")
    assert (head.train.warm_prompts, head.train.warm_max_new_tokens) == (256, 64)  # the layer's, untouched
    seen = head.for_warm_start("head").train
    assert (seen.warm_prompts, seen.warm_max_new_tokens, seen.warm_turns) == (7, 9, "first")
    assert head.for_warm_start("head").for_warm_start("head") == head.for_warm_start("head")  # idempotent
    assert head.for_warm_start("layer") == head
    layer = draft_init_config(OSDConfig(), build_parser().parse_args(["draft", "init", "--family", "layer", *flags]))
    assert (layer.train.warm_prompts, layer.train.warm_max_new_tokens, layer.train.warm_turns) == (7, 9, "first")
    assert layer.train.head_warm_prompts == OSDConfig().train.head_warm_prompts
    # Defaults: the head answers 1536 prompts of every human turn, 128 tokens, with no ShareGPT text.
    d = OSDConfig().for_warm_start("head").train
    assert (d.warm_prompts, d.warm_max_new_tokens, d.warm_turns) == (1536, 128, "all")
    assert build_parser().parse_args(["draft", "init"]).conversations is None  # the warm start's: none
    assert OSDConfig.model_validate({"train": {"head_warm_budget_minutes": None}}).for_warm_start(
        "head").train.warm_budget_minutes is None  # null in the config: every prompt


def test_model_flag_names_the_target_for_serve_and_draft_init(monkeypatch, tmp_path):
    from pipeline.cli import run

    model = tmp_path / "m.gguf"
    init = draft_init_config(OSDConfig(), build_parser().parse_args(["draft", "init", "--model", str(model)]))
    assert init.model.target == str(model)
    seen = {}
    monkeypatch.setattr("pipeline.stack.launch.run_server", lambda cfg, api_key=None: seen.setdefault("cfg", cfg) and 0)
    args = build_parser().parse_args(["serve", "--model", str(model)])
    run._cmd_serve(OSDConfig(), args)
    assert seen["cfg"].model.target == str(model)
