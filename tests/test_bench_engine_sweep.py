"""`osd bench engine --k-sweep`, `--confidence-sweep` and `--vs-torch-head`: other draft budgets,
confidence stops and a head's PyTorch kernels timed in the same run as own AR, under the HF
schedule (the cost rule would make a swept setting's drafting depend on the machine's timings)."""

import json

import pytest

from pipeline.cli import main


def test_each_swept_k_gets_its_row_and_the_same_greedy_output(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("hello there", "write a loop")))
    out = tmp_path / "b.json"
    rc = main(["bench", "engine", "--target", "tiny-random", "--draft", "truncate:1", "--prompts-file", str(prompts),
               "--max-new-tokens", "12", "--k", "3", "--k-sweep", "1", "2", "3", "--no-hf", "--k-policy", "schedule",
               "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert [row["k"] for row in r["k_sweep"]] == [1, 2, 3]  # the run's own k once, from its `sd` method
    assert r["k_sweep"][2]["tokens_per_target_step"] == r["tokens_per_target_step"]
    for row in r["k_sweep"]:
        assert row["sd_vs_ar"] > 0 and 1.0 <= row["tokens_per_target_step"] <= row["k"] + 1
    assert r["greedy_identical"] and {"sd_k1", "sd_k2"} <= set(r["median_tok_s"])
    printed = capsys.readouterr().out
    assert "own speculative, k=1" in printed and "k=2: own SD / own AR" in printed


@pytest.mark.parametrize("bad", ["0", "two"])
def test_a_bad_k_in_the_sweep_is_refused_by_name(bad, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "engine", "--k-sweep", "1", bad])
    assert e.value.code == 2
    assert "--k-sweep" in capsys.readouterr().err


def test_each_swept_confidence_stop_gets_its_row_and_the_same_greedy_output(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("hello there", "write a loop")))
    out = tmp_path / "b.json"
    rc = main(["bench", "engine", "--target", "tiny-random", "--draft", "truncate:1", "--prompts-file", str(prompts),
               "--max-new-tokens", "12", "--k", "3", "--confidence-sweep", "0.5", "0.999", "--no-hf", "--k-policy", "schedule",
               "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    rows = r["confidence_sweep"]
    assert [row["draft_confidence"] for row in rows] == [0.0, 0.5, 0.999]  # the run's own (0) from `sd`
    assert rows[0]["tokens_per_target_step"] == r["tokens_per_target_step"] and r["k_sweep"] is None
    # A stop at 0.999 ends nearly every draft at its first token: fewer drafted per step.
    drafted = {m: r["median_tok_s"][m] for m in ("sd_conf0.5", "sd_conf0.999")}
    assert all(v > 0 for v in drafted.values())
    assert rows[2]["tokens_per_target_step"] <= rows[0]["tokens_per_target_step"]
    assert r["greedy_identical"] and "sd_chain" not in r["median_tok_s"]
    printed = capsys.readouterr().out
    assert "own speculative, conf=0.5" in printed and "draft_confidence=0.999: own SD / own AR" in printed


@pytest.mark.parametrize("bad", ["1", "-0.1", "high"])
def test_a_bad_confidence_in_the_sweep_is_refused_by_name(bad, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "engine", "--confidence-sweep", bad])
    assert e.value.code == 2
    assert "--confidence-sweep" in capsys.readouterr().err


def test_the_head_on_pytorch_is_timed_beside_the_native_head(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("hello there", "write a loop")))
    out = tmp_path / "b.json"
    rc = main(["bench", "engine", "--target", "tiny-random", "--draft", "head:untrained", "--quant", "int4",
               "--prompts-file", str(prompts), "--max-new-tokens", "12", "--k", "2", "--no-hf",
               "--k-policy", "schedule", "--vs-torch-head", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    th = r["torch_head"]
    assert th["tok_s"] > 0 and th["vs_ar"] > 0 and th["sd_vs_torch_head_median"] > 0
    assert 1.0 <= th["tokens_per_target_step"] <= 3 and th["draft_cost_per_token"] > 0
    assert r["greedy_identical"] and "sd_torch_head" in r["median_tok_s"]
    printed = capsys.readouterr().out
    assert "own speculative, head on PyTorch" in printed and "head on PyTorch, same run" in printed


def test_the_head_on_pytorch_needs_a_head_draft(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello there"}) + "\n")
    rc = main(["bench", "engine", "--target", "tiny-random", "--draft", "truncate:1", "--prompts-file", str(prompts),
               "--max-new-tokens", "4", "--no-hf", "--vs-torch-head", "--json", str(tmp_path / "b.json")])
    assert rc == 2
    assert "--vs-torch-head compares a head draft" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()
