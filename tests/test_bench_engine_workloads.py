"""`osd bench engine` with the suffix drafts, conversations from a prompts file, and the
multi-turn workload (second turns after the target's own first answers)."""

import json

import pytest

from pipeline.cli import main


def _bench(tmp_path, *args):
    out = tmp_path / "b.json"
    rc = main(["bench", "engine", "--target", "tiny-random", "--max-new-tokens", "12", "--no-hf",
               "--json", str(out), *args])
    assert rc == 0
    return json.loads(out.read_text())


def test_conversations_in_a_prompts_file_and_the_suffix_draft(tmp_path):
    prompts = tmp_path / "p.jsonl"
    conv = {"messages": [{"role": "user", "content": "name a color"}, {"role": "assistant", "content": "blue"},
                         {"role": "user", "content": "another one"}]}
    prompts.write_text(json.dumps(conv) + "\n" + json.dumps({"prompt": "hello there"}) + "\n")
    r = _bench(tmp_path, "--draft", "suffix", "--prompts-file", str(prompts))
    assert r["greedy_identical"] and r["draft"] == "suffix"


def test_the_multiturn_workload_replays_second_turns(tmp_path, capsys):
    r = _bench(tmp_path, "--draft", "head:untrained+suffix", "--workload", "multiturn", "--prompts", "2",
               "--max-prompt-chars", "120")
    assert r["greedy_identical"]
    assert "multi-turn: 2 conversations" in capsys.readouterr().out


def test_multiturn_takes_no_prompts_file(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    assert main(["bench", "engine", "--target", "tiny-random", "--draft", "suffix", "--workload", "multiturn",
                 "--prompts-file", str(prompts), "--no-hf"]) == 2
    assert "ShareGPT, not --prompts-file" in capsys.readouterr().err
