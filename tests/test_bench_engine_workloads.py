"""`osd bench engine` with the suffix drafts, conversations from a prompts file, and the
multi-turn workload (second turns after the target's own first answers)."""

import json

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


def test_a_learning_draft_gets_its_own_index_per_method_and_capture_off_repeats(tmp_path):
    """Each speculative method (here the tree and its chain) drafts from its own index, so
    neither drafts from the other's answer to the same prompt; the capture-off run always
    follows the captured one (a full repeat), and no capture overhead is claimed from it."""
    r = _bench(tmp_path, "--draft", "suffix", "--prompts", "4", "--tree", "4,3,2", "--max-prompt-chars", "200")
    assert r["greedy_identical"] and r["nocapture_is_repeat"] and r["capture_overhead_pct"] is None


def test_pinned_methods_run_right_after_their_anchor():
    from pipeline.bench.engine import time_methods

    seen = []

    def method(name):
        return lambda ids, n: (seen.append(name) or [1], None, None)

    runners = {m: method(m) for m in ("ar", "sd", "sd_nocapture", "sd_chain")}
    time_methods(runners, [[1]] * 4, 2, lambda s: None, {"sd_nocapture": "sd"})
    rounds = [seen[4 + 4 * i: 8 + 4 * i] for i in range(4)]  # after the warm-up calls
    assert all(r[r.index("sd") + 1] == "sd_nocapture" for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1  # the others still rotate


def test_each_method_prefills_each_prompt_itself_unless_prefix_reuse_is_asked_for(tmp_path):
    """The methods run each prompt in turn on the same slots: with reuse, the later ones would
    start from the earlier one's prefill of the same prompt."""
    off = _bench(tmp_path, "--draft", "truncate:1", "--prompts", "2", "--max-prompt-chars", "200")
    on = _bench(tmp_path, "--draft", "truncate:1", "--prompts", "2", "--max-prompt-chars", "200", "--prefix-reuse")
    assert (off["prefix_reuse"], off["cached_prompt_tokens"]) == (False, 0)
    assert on["prefix_reuse"] and on["cached_prompt_tokens"] > 0
    assert off["greedy_identical"] and on["greedy_identical"]
