"""The benches that measure what a step costs: `osd bench forward` (weight formats in one run)
and the step-cost figures of `osd bench engine` (V by T, decode without prefill, draft cost),
on the tiny target. They assert what is reported, never how fast anything ran."""

import json
import sys

import pytest
import torch

from infra.target import build_tiny_llama
from pipeline.bench.forward import build_runners, run_forward_bench
from pipeline.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_forward_bench_times_every_variant_and_token_count(tmp_path):
    model = build_tiny_llama(seed=0, hidden_size=64, intermediate_size=128, max_positions=128)
    out = tmp_path / "f.json"
    r = run_forward_bench(variants=("float32", "bfloat16", "int4", "int4-bf16wide"), tokens=(1, 3, 24),
                          context=16, repeats=2, max_seq_len=128, real=model, json_path=str(out), log=lambda s: None)
    assert json.loads(out.read_text()) == r
    assert set(r["ms"]) == {"float32", "bfloat16", "int4", "int4-bf16wide"} and r["weights"] == "real"
    for name, by_t in r["ms"].items():
        assert set(by_t) == {"1", "3", "24"} and all(v > 0 for v in by_t.values())
        assert r["vs_t1"][name]["1"] == 1.0


def test_forward_bench_times_cells_back_to_back_on_request(tmp_path, monkeypatch):
    from pipeline.bench import forward

    model = build_tiny_llama(seed=0, hidden_size=64, intermediate_size=128, max_positions=128)
    bursts = []
    real_cell = forward._cell
    monkeypatch.setattr(forward, "_cell", lambda *a: bursts.append(a[-1]) or real_cell(*a))
    r = run_forward_bench(variants=("float32",), tokens=(1, 3), context=16, repeats=2, max_seq_len=128,
                          real=model, burst=4, log=lambda s: None)
    assert r["burst"] == 4 and all(v > 0 for v in r["ms"]["float32"].values())
    assert bursts == [1] * 6 + [4] * 4  # 3 warm-up rounds of one forward, then the timed rounds
    with pytest.raises(ValueError, match="burst"):
        run_forward_bench(variants=("float32",), tokens=(1,), context=16, repeats=1, max_seq_len=128,
                          real=model, burst=0, log=lambda s: None)


def test_forward_bench_refuses_unknown_or_misplaced_variants():
    with pytest.raises(ValueError, match="unknown variant"):
        build_runners(["int3"], "cpu", 64, 3)
    with pytest.raises(ValueError, match="CPU path"):
        build_runners(["int4"], "cuda", 64, 3)
    with pytest.raises(ValueError, match="CPU path"):
        build_runners(["int4-bf16wide"], "cuda", 64, 3)


def test_a_native_library_built_elsewhere_runs_beside_this_checkouts(tmp_path, monkeypatch):
    from serve.model import native_build

    if not native_build.supported():
        pytest.skip("this CPU runs no native variant")
    monkeypatch.setenv("OSD_NATIVE_DIR", str(tmp_path / "other"))  # a second build, as main's would be
    lib = native_build.build(native_build.supported()[0])
    model = build_tiny_llama(seed=0, hidden_size=64, intermediate_size=128, max_positions=128)
    runners = build_runners(["int4-native"], "cpu", 64, 3, real=model, native_libs=[str(lib)])
    other = runners[f"int4-native@{lib.parent.name}"]
    assert other.lib is not runners["int4-native"].lib
    tokens = torch.tensor([1, 2, 3])
    assert torch.equal(other.forward(tokens, other.new_cache()),
                       runners["int4-native"].forward(tokens, runners["int4-native"].new_cache()))
    with pytest.raises(ValueError, match="native-lib"):
        build_runners(["float32"], "cuda", 64, 3, native_libs=[str(lib)])


def test_the_bf16wide_variant_keeps_bfloat16_wide_weights_on_any_cpu():
    from serve.model.linear import Dense

    model = build_tiny_llama(seed=0, hidden_size=64, intermediate_size=128, max_positions=128)
    runners = build_runners(["int4", "int4-bf16wide"], "cpu", 64, 3, real=model)
    wide = runners["int4-bf16wide"].prefill_blocks[0][1]
    assert isinstance(wide, Dense) and wide.weight.dtype == torch.bfloat16


def _prompts(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("hello there", "write a loop")))
    return str(p)


def test_engine_bench_reports_the_step_costs_of_an_int4_target(tmp_path, capsys):
    out = tmp_path / "e.json"
    rc = main(["bench", "engine", "--target", "tiny-random", "--draft", "truncate:1", "--prompts-file",
               _prompts(tmp_path), "--max-new-tokens", "12", "--k", "3", "--k-policy", "fixed", "--quant", "int4",
               "--no-hf", "--vs-float32", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["quant"] == "int4" and r["dtype"] == "bfloat16" and r["k_policy"] == "fixed"
    assert r["ar_decode_tok_s"] > 0 and r["one_token_forward_ms"] > 0
    # Fixed k=3 verifies 4 tokens a step (fewer only at the token budget's end).
    assert "4" in r["verify_cost_by_tokens"] and r["verify_cost_by_tokens"]["4"]["steps"] >= 2
    assert r["draft_cost_per_token"] > 0
    assert all(m["reference"] == "ar" for m in r["mismatches"])  # int4 is checked against its own AR
    agree = r["float32_agreement"]  # the float32 target ran in the same run, as information
    assert agree["prompts"] == 2 and len(agree["first_diff"]) == 2 and r["ar_vs_ar_float32"] > 0
    printed = capsys.readouterr().out
    assert "verify forward by T" in printed and "vs the float32 target" in printed


def test_engine_bench_vs_llamacpp_needs_the_gguf_target_and_the_package(tmp_path, capsys, monkeypatch):
    args = ["bench", "engine", "--target", "tiny-random", "--draft", "truncate:1", "--prompts-file",
            _prompts(tmp_path), "--max-new-tokens", "4", "--no-hf", "--vs-llamacpp", "--json", str(tmp_path / "e.json")]
    assert main(args) == 2
    assert "GGUF" in capsys.readouterr().err
    from pipeline.bench.llamacpp import llamacpp_method

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # not installed
    with pytest.raises(ValueError, match=r"needs llama-cpp-python.*\.\[bench\]"):
        llamacpp_method(tmp_path / "x.gguf", 2, 64, None)


class _FakeLlama:
    """llama_cpp.Llama's generate as the bench uses it: it starts from the longest prefix of the
    prompt its context holds (as llama-cpp-python does, reset=True or not) unless reset() emptied it."""

    def __init__(self, **kw):
        self.held: list[int] = []
        self.evaluated: list[int] = []  # prompt tokens each call computed

    def token_eos(self):
        return 0

    def reset(self):
        self.held = []

    def generate(self, ids, **kw):
        same = [a == b for a, b in zip(self.held, ids[:-1])]
        keep = same.index(False) if False in same else len(same)
        self.evaluated.append(len(ids) - keep)
        self.held = list(ids)
        while True:
            yield 7


@pytest.mark.parametrize("reuse", [False, True])
def test_the_llamacpp_method_prefills_each_prompt_unless_prefix_reuse_is_asked_for(tmp_path, monkeypatch, reuse):
    from types import SimpleNamespace

    from pipeline.bench.llamacpp import llamacpp_method

    made = []
    fake = SimpleNamespace(Llama=lambda **kw: made.append(_FakeLlama(**kw)) or made[-1])
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    run = llamacpp_method(tmp_path / "x.gguf", 2, 64, None, prefix_reuse=reuse)
    prompt = [1, 2, 3, 4, 5]
    assert run(prompt, 3)[0] == [7, 7, 7]
    run(prompt, 3)  # the same prompt again, as the next method of a prompt's round would send it
    assert made[0].evaluated == ([5, 1] if reuse else [5, 5])


def test_engine_bench_refuses_int4_outside_bfloat16_with_a_clear_error(tmp_path, capsys):
    rc = main(["bench", "engine", "--target", "tiny-random", "--draft", "truncate:1", "--prompts-file",
               _prompts(tmp_path), "--quant", "int4", "--dtype", "float32", "--no-hf"])
    assert rc == 2
    assert "int4 is the CPU bfloat16 path" in capsys.readouterr().err
