"""`osd bench engine`: own AR and speculative decoding against Hugging Face, one process.

Every method decodes the same prompts greedily with the same token budget and stops at
EOS. Speeds are tokens generated / wall seconds (prefill included, as a user sees it),
summed over prompts; the per-prompt median is printed beside it. Methods run in an
interleaved order per prompt so slow drift of the machine hits all of them alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from tabulate import tabulate

from infra.config import OSDConfig
from infra.prompts import Prompt, messages_ids, select_prompts, sharegpt_second_turns
from pipeline.argtypes import positive_int, probability_below_1
from pipeline.bench.online_offline import drafted_rows, offline_figures

if TYPE_CHECKING:  # the model libraries load when a bench runs, not when the CLI parses its flags
    from serve.engine.core import EngineOptions, SpecEngine, SpecStats

METHODS = ("hf_ar", "hf_assisted", "ar", "sd", "sd_nocapture", "llamacpp", "ar_float32")
# With --compile on (CUDA graphs), the eager engine runs in the same process for comparison.
EAGER_METHODS = ("ar_eager", "sd_eager")
# With --tree, chains of the same draft run in the same process for comparison.
CHAIN_METHODS = ("sd_chain",)
LABELS = {
    "hf_ar": "HF generate (AR)",
    "llamacpp": "llama.cpp (same GGUF, AR)",
    "ar_float32": "own AR, float32 target",
    "hf_assisted": "HF assisted (same draft)",
    "ar": "own AR",
    "sd": "own speculative",
    "sd_nocapture": "own speculative, capture off",
    "ar_eager": "own AR, eager",
    "sd_eager": "own speculative, eager",
    "sd_chain": "own speculative, chain",
    "sd_torch_head": "own speculative, head on PyTorch",
}


@dataclass
class MethodRun:
    tokens: list[int] = field(default_factory=list)  # tokens generated per prompt
    seconds: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    decode_seconds: list[float] = field(default_factory=list)  # own methods: after prefill

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens per second after the prompt: the decode loop alone (own methods only)."""
        if len(self.decode_seconds) != len(self.tokens) or not sum(self.decode_seconds):
            return None
        # The first token comes out of the prefill's last forward, not the decode loop.
        return sum(t - 1 for t in self.tokens) / sum(self.decode_seconds)

    @property
    def tok_s(self) -> float:
        return sum(self.tokens) / sum(self.seconds) if self.seconds else 0.0

    @property
    def median_tok_s(self) -> float:
        return statistics.median(t / s for t, s in zip(self.tokens, self.seconds)) if self.seconds else 0.0


def _hf_generate(model, ids: list[int], max_new: int, eos: int | None, pad: int, assistant=None) -> list[int]:
    import torch

    x = torch.tensor([ids], device=model.device)
    kw: dict[str, Any] = dict(max_new_tokens=max_new, do_sample=False, pad_token_id=pad, eos_token_id=eos,
                              attention_mask=torch.ones_like(x))
    if assistant is not None:
        kw["assistant_model"] = assistant
    with torch.inference_mode():
        out = model.generate(x, **kw)
    return out[0, len(ids):].tolist()


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _top2_gap(runner, prefix: list[int]) -> float:
    """Gap between the target's two largest logits after `prefix`, from the engine's own
    one-token-at-a-time decoding forward (the runner AR uses), in its dtype."""
    import torch

    cache = runner.new_cache()
    logits = runner.forward(torch.tensor(prefix, device=runner.device), cache)[-1]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def reference_methods(mcfg: Any, loaded: Any, max_seq_len: int, vs_llamacpp: bool,
                      vs_float32: bool, prefix_reuse: bool = False) -> dict[str, MethodFn]:
    """Baselines outside the engine under test, timed in the same run: llama.cpp on the GGUF,
    and own AR over the float32 target (the runner before bfloat16 and int4)."""
    from infra.target import load_target
    from serve.engine.core import EngineOptions, GenerationParams, SpecEngine

    out: dict[str, MethodFn] = {}
    if vs_llamacpp:
        out["llamacpp"] = _llamacpp(loaded, mcfg.target, max_seq_len, prefix_reuse)
    if vs_float32 and (mcfg.dtype, mcfg.quant) != ("float32", "none"):
        f32 = load_target(mcfg.target, mcfg.for_training(), progress=False)
        options = EngineOptions(k=0, max_seq_len=max_seq_len, max_concurrency=1, prefix_reuse=prefix_reuse)
        eng = SpecEngine(f32.model, None, f32.tokenizer, options)

        def ar_float32(ids: list[int], n: int):
            r = eng.generate(ids, GenerationParams(max_new_tokens=n))
            return r.output_ids, None, r.decode_s

        out["ar_float32"] = ar_float32
    return out


def hf_mismatches(runner: Any, runs: dict[str, MethodRun], ids_list: list[list[int]]) -> list[dict[str, Any]]:
    """Information: where own AR (bfloat16 or int4) first differs from HF generate (its own
    rounding of the bfloat16 model), with the top-2 logit gap there."""
    out = []
    for i, (ref, got) in enumerate(zip(runs["hf_ar"].outputs, runs["ar"].outputs)):
        pos = _first_diff(ref, got)
        if pos is not None:
            gap = _top2_gap(runner, ids_list[i] + got[:pos]) if pos < len(got) else None
            out.append({"prompt": i, "position": pos, "top2_logit_gap": gap})
    return out


def float32_agreement(runs: dict[str, MethodRun]) -> dict[str, Any] | None:
    """Information, not a check: on how many prompts own AR's greedy output (this run's dtype
    and weights) equals the float32 target's, and where each first differs."""
    if "ar_float32" not in runs:
        return None
    diffs = [_first_diff(a, b) for a, b in zip(runs["ar_float32"].outputs, runs["ar"].outputs)]
    return {"equal": sum(d is None for d in diffs), "prompts": len(diffs), "first_diff": diffs}


def _llamacpp(loaded: Any, spec: str, n_ctx: int, prefix_reuse: bool):
    import torch

    from infra.target import SMOLLM2, smollm2_gguf_path
    from pipeline.bench.llamacpp import llamacpp_method

    if spec != SMOLLM2:
        raise ValueError(f"--vs-llamacpp runs the GGUF the target {SMOLLM2} comes from; the target here is {spec!r}")
    return llamacpp_method(smollm2_gguf_path(), torch.get_num_threads(), n_ctx, loaded.tokenizer.eos_token_id,
                           prefix_reuse)


def second_turn_prompts(cfg: OSDConfig, n: int, max_chars: int) -> list[Prompt]:
    """Held-out ShareGPT conversations with two human turns within max_chars each, as
    conversations still missing the assistant's first answer (answer_first_turns adds it)."""
    from infra.prompts import split_of

    data = cfg.data.model_copy(update={"max_prompt_chars": min(cfg.data.max_prompt_chars, max_chars)})
    convs = sharegpt_second_turns(data)[:n]
    return [Prompt(cid, second, "other", split_of(cid), (("user", first), ("user", second)))
            for cid, (first, second) in convs]


def conversation_turns(cfg: OSDConfig, n: int, max_chars: int) -> list[tuple[str, ...]]:
    """The user turns (first, second) of second_turn_prompts' conversations."""
    return [tuple(text for _, text in p.messages) for p in second_turn_prompts(cfg, n, max_chars)]


def answer_first_turns(engine: SpecEngine, tokenizer: Any, prompts: list[Prompt], max_new_tokens: int,
                       log: Callable[[str], None]) -> list[Prompt]:
    """The multi-turn workload's prompts: each conversation's second turn after the target's own
    greedy answer to its first (autoregressive, outside every timed run)."""
    from serve.engine.core import GenerationParams

    out = []
    for p in prompts:
        (_, first), (_, second) = p.messages
        answer = engine.generate(messages_ids(tokenizer, [{"role": "user", "content": first}]),
                                 GenerationParams(max_new_tokens=max_new_tokens, speculate=False, capture=False))
        out.append(dataclasses.replace(p, messages=(("user", first), ("assistant", answer.text or ""),
                                                    ("user", second))))
    log(f"multi-turn: {len(out)} conversations, each second turn after the target's own first answer")
    return out


def run_bench(cfg: OSDConfig, *, n_prompts: int = 8, prompts_file: str | None = None, limit: int | None = None,
              max_new_tokens: int = 96, k: int = 4, draft_spec: str = "truncate:4", device: str = "cpu",
              max_prompt_chars: int = 1000, json_path: str | None = None, target: str | None = None,
              compile: str = "auto", dtype: str | None = None, hf: bool = True, tree: str = "",
              k_sweep: Sequence[int] = (), confidence_sweep: Sequence[float] = (), quant: str | None = None,
              vs_llamacpp: bool = False, k_policy: str | None = None, vs_float32: bool = False,
              workload: str = "single", vs_torch_head: bool = False, prefix_reuse: bool = False,
              log: Callable[[str], None] = lambda s: print(s, flush=True)) -> dict[str, Any]:
    import torch

    from infra.target import load_target
    from serve.engine.core import EngineOptions
    from serve.spec_decode.specs import build_draft

    mcfg = bench_model_config(cfg, device, target, dtype, quant)
    loaded = load_target(mcfg.target, mcfg, progress=True)
    draft_spec = resolve_draft_spec(cfg, mcfg, draft_spec)
    draft = build_draft(draft_spec, loaded.model, suffix=cfg.serve.suffix)
    if draft is None:
        raise ValueError("osd bench engine needs a draft: --draft self, truncate:L, head:init or a directory")
    # A draft that learns from what it serves (the suffix draft's index): every engine gets its
    # own, so a method never drafts from another method's answer to the same prompt (their
    # greedy outputs are equal, so each index grows alike).
    learns = draft_spec == "suffix" or draft_spec.endswith("+suffix")

    def own_draft() -> Any:
        return build_draft(draft_spec, loaded.model, suffix=cfg.serve.suffix) if learns else draft

    prompts = bench_prompts(cfg, workload, n_prompts, prompts_file, max_prompt_chars, limit)
    graphs = "on" if compile == "on" else "off" if compile == "off" else "auto"
    # Off by default: every method runs every prompt on the same slots, so with reuse on, a
    # method would start from the keys and values the method before it computed for the same
    # prompt, and only the first to run a prompt would pay its prefill.
    serve_update = {"k": k, "cuda_graphs": graphs, "tree": tree, "prefix_reuse": prefix_reuse,
                    **({"k_policy": k_policy} if k_policy else {})}
    options = EngineOptions.from_config(cfg.serve.model_copy(update=serve_update), mcfg)
    engines = BenchEngines.build(loaded, draft, own_draft, options, graphs, tree, k_sweep, confidence_sweep,
                                 vs_torch_head)
    engine = engines.engine
    if workload == "multiturn":
        prompts = answer_first_turns(engine, loaded.tokenizer, prompts, max_new_tokens, log)
    ids_list = [messages_ids(loaded.tokenizer, p.chat()) for p in prompts]
    log(f"== osd bench engine: target {loaded.spec}, draft {draft_spec}, k={k}, {len(prompts)} prompts, "
        f"max_new_tokens={max_new_tokens}, device={device}, dtype={mcfg.dtype}, quant={mcfg.quant}, "
        f"k_policy={options.k_policy}, cuda graphs "
        f"{'on' if engines.eager else 'off'}, tree {tree or 'none (chains)'}, threads={torch.get_num_threads()}")
    runners = method_runners(engine, loaded, draft, engines.eager, engines.chain, engines.sweep)
    if not hf:
        runners = {m: fn for m, fn in runners.items() if not m.startswith("hf_")}
    runners.update(reference_methods(mcfg, loaded, engine.max_seq_len, vs_llamacpp, vs_float32,
                                     prefix_reuse))
    # The capture-off run shares the speculative engine's draft; one that learns then drafts
    # from the captured run's answer: it runs right after it, as a full repeat, every prompt.
    runs, stats, capture_ratios = time_methods(runners, ids_list, max_new_tokens, log,
                                               {"sd_nocapture": "sd"} if learns else None)
    result = bench_figures(loaded, mcfg, engines, draft, runs, stats, capture_ratios, ids_list, max_new_tokens,
                           learns, vs_torch_head, k_sweep, confidence_sweep)
    result.update(run_facts(loaded, mcfg, engines, tree, draft_spec, k, prefix_reuse, len(prompts), max_new_tokens,
                            device))
    if draft_spec == "self":
        result.update(self_draft_cost(runs, k))
    print_table(result, runs, log)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2))
        log(f"wrote {json_path}")
    return result


def run_facts(loaded: Any, mcfg: Any, engines: "BenchEngines", tree: str, draft_spec: str, k: int,
              prefix_reuse: bool, prompts: int, max_new_tokens: int, device: str) -> dict[str, Any]:
    """What ran, for the JSON: the target, the draft, the engines' settings and the machine."""
    import torch

    return {
        "cuda_graphs": engines.eager is not None,
        "tree": tree or None,
        "dtype": mcfg.dtype,
        "quant": mcfg.quant,
        "target": loaded.spec,
        "draft": draft_spec,
        "k": k,
        "prefix_reuse": prefix_reuse,
        # Prompt tokens a request of the engines under test (not the float32 reference's) took from
        # a slot's cache instead of computing them: 0 with reuse off.
        "cached_prompt_tokens": sum(e.scheduler.cached_tokens for e in engines.all()),
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "device": device,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }


def resolve_draft_spec(cfg: OSDConfig, mcfg: Any, draft_spec: str) -> str:
    """head:init and head+suffix name the warm-started head: built once, then taken from disk."""
    if draft_spec not in ("head:init", "head+suffix"):
        return draft_spec
    from train.warm.head import run_head_warm_start

    head = run_head_warm_start(cfg.model_copy(update={"model": mcfg}))["path"]
    return head if draft_spec == "head:init" else f"{head}+suffix"


def bench_prompts(cfg: OSDConfig, workload: str, n_prompts: int, prompts_file: str | None,
                  max_prompt_chars: int, limit: int | None) -> list:
    """The bench's prompts: --max-prompt-chars and --prompts pick from ShareGPT; a prompts file
    is used whole; multiturn takes held-out conversations (their first turns, answered later)."""
    if workload == "multiturn":
        if prompts_file:
            raise ValueError("--workload multiturn takes its conversations from ShareGPT, not --prompts-file")
        prompts = second_turn_prompts(cfg, n_prompts, max_prompt_chars)
    else:
        prompts = select_prompts(cfg.data, None if prompts_file else n_prompts, prompts_file,
                                 max_prompt_chars=None if prompts_file else max_prompt_chars)
    prompts = prompts[:limit] if limit else prompts
    if not prompts:
        raise ValueError("no prompts selected")
    return prompts


@dataclass
class BenchEngines:
    """The engines a run times: the speculative one, its eager twin (CUDA graphs on), its chain
    twin (trees on), and the sweep's, each with its own draft where the draft learns."""

    engine: Any
    eager: Any = None
    chain: Any = None
    sweep: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, loaded: Any, draft: Any, own_draft: Callable[[], Any], options: Any, graphs: str, tree: str,
              k_sweep: Sequence[int], confidence_sweep: Sequence[float], vs_torch_head: bool) -> "BenchEngines":
        from serve.engine.core import SpecEngine

        engine = SpecEngine(loaded.model, draft, loaded.tokenizer, options)
        out = cls(engine)
        if engine.gpu and graphs != "off":
            out.eager = SpecEngine(loaded.model, own_draft(), loaded.tokenizer,
                                   dataclasses.replace(options, cuda_graphs="off"))
        if tree:
            out.chain = SpecEngine(loaded.model, own_draft(), loaded.tokenizer, dataclasses.replace(options, tree=""))
        # Other draft budgets and confidence stops in the same run, interleaved per prompt with own
        # AR: the machine's speed drifts between runs, a ratio measured in one run does not.
        out.sweep = {m: SpecEngine(loaded.model, own_draft(), loaded.tokenizer, o)
                     for m, o in sweep_options(options, k_sweep, confidence_sweep).items()}
        if vs_torch_head:  # the same head drafting through PyTorch, interleaved: sd_torch_head
            out.sweep["sd_torch_head"] = torch_head_engine(loaded, own_draft(), options)
        return out

    def all(self) -> list[Any]:
        return [e for e in (self.engine, self.eager, self.chain, *self.sweep.values()) if e is not None]


def bench_figures(loaded: Any, mcfg: Any, engines: BenchEngines, draft: Any, runs: dict, stats: dict,
                  capture_ratios: Any, ids_list: list, max_new_tokens: int, learns: bool, vs_torch_head: bool,
                  k_sweep: Sequence[int], confidence_sweep: Sequence[float]) -> dict[str, Any]:
    """What the timed runs say: speeds, greedy identity, the draft's figures, offline agreement,
    step costs and the sweeps."""
    engine = engines.engine
    # Lossless means equal to the same target's own decoding: in float32 that is HF's too; in
    # bfloat16 HF rounds differently op by op, and int4 is not a model HF runs, so speculation
    # is checked against own AR there, and own AR against HF is reported beside it.
    reference = "ar" if (mcfg.dtype, mcfg.quant) != ("float32", "none") else None
    result = summarize(runs, stats, None if learns else capture_ratios,
                       greedy_mismatches(engine.target, runs, ids_list, reference), engine.options)
    result["nocapture_is_repeat"] = learns
    result["greedy_reference"] = reference or ("hf_ar" if "hf_ar" in runs else "ar")
    result["ar_vs_hf_mismatches"] = (hf_mismatches(engine.target, runs, ids_list)
                                     if reference == "ar" and "hf_ar" in runs else None)
    result.update(draft_figures(stats["sd"], runs, draft))
    head_engines = {"sd": engine, **({"sd_torch_head": engines.sweep["sd_torch_head"]} if vs_torch_head else {})}
    drafted = ({m: drafted_rows(e, ids_list, runs["ar"].outputs, max_new_tokens) for m, e in head_engines.items()}
               if getattr(draft, "osd_family", None) == "head" else None)
    result.update(offline_figures(loaded.model, engine.target, draft, ids_list, runs["ar"].outputs,
                                  result["acceptance_per_pos"], drafted))
    result.update(step_cost_figures(stats, runs))
    result["torch_head"] = torch_head_figures(stats, runs, draft) if vs_torch_head else None
    result["k_sweep"] = sweep_rows(runs, stats, "k", engine.options.k) if k_sweep else None
    result["confidence_sweep"] = (sweep_rows(runs, stats, "draft_confidence", engine.options.draft_confidence)
                                  if confidence_sweep else None)
    return result


# (prompt ids, token budget) -> (output ids, speculative stats or None, decode seconds or None)
def bench_model_config(cfg: OSDConfig, device: str, target: str | None, dtype: str | None,
                       quant: str | None) -> Any:
    """The model config the bench runs: the flags over model.*, validated (int4 needs CPU
    bfloat16), then `auto` made concrete for the target."""
    update: dict[str, Any] = {"device": device, **({"target": target} if target else {}),
                              **({"dtype": dtype} if dtype else {}), **({"quant": quant} if quant else {})}
    if quant == "int4" and not dtype:
        update["dtype"] = "bfloat16"  # int4's activation dtype
    if dtype and dtype != "bfloat16" and not quant:
        update["quant"] = "none"  # an explicit other dtype: the weights as loaded
    return type(cfg.model).model_validate({**cfg.model.model_dump(), **update}).resolved()


MethodFn = Callable[[list[int], int], tuple[list[int], "SpecStats | None", "float | None"]]


def method_runners(engine: SpecEngine, loaded: Any, draft: Any, eager: SpecEngine | None = None,
                   chain: SpecEngine | None = None, sweep: dict[str, SpecEngine] | None = None
                   ) -> dict[str, MethodFn]:
    """Each method as (prompt ids, token budget) -> (output ids, speculative stats or None)."""
    from serve.engine.core import GenerationParams

    model, tok = loaded.model, loaded.tokenizer
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def own(ids, n, speculate: bool, capture: bool, eng: SpecEngine = engine):
        r = eng.generate(ids, GenerationParams(max_new_tokens=n, speculate=speculate, capture=capture))
        return r.output_ids, r.stats, r.decode_s

    def assisted(ids, n):
        # HF cannot drive a head draft (its inputs are the target's features): not timed then.
        if getattr(draft, "osd_family", None) == "head":
            return [], None, None
        return _hf_generate(model, ids, n, eos, pad, assistant=draft), None, None

    runners: dict[str, MethodFn] = {
        "hf_ar": lambda ids, n: (_hf_generate(model, ids, n, eos, pad), None, None),
        "hf_assisted": assisted,
        "ar": lambda ids, n: own(ids, n, False, True),
        "sd": lambda ids, n: own(ids, n, True, True),
        "sd_nocapture": lambda ids, n: own(ids, n, True, False),
    }
    if eager is not None:
        runners["ar_eager"] = lambda ids, n: own(ids, n, False, True, eager)
        runners["sd_eager"] = lambda ids, n: own(ids, n, True, True, eager)
    if chain is not None:
        runners["sd_chain"] = lambda ids, n: own(ids, n, True, True, chain)
    for m, eng in (sweep or {}).items():
        runners[m] = lambda ids, n, eng=eng: own(ids, n, True, True, eng)
    return runners


# Swept settings: method name prefix -> the EngineOptions field it sets (sd_k2, sd_conf0.3).
SWEPT = {"sd_k": "k", "sd_conf": "draft_confidence"}


def sweep_options(options: EngineOptions, k_sweep: Sequence[int] = (),
                  confidence_sweep: Sequence[float] = ()) -> dict[str, EngineOptions]:
    """Method name -> the run's options with one setting changed; the run's own value is its `sd`."""
    out = {f"sd_k{kk}": dataclasses.replace(options, k=kk) for kk in sorted(set(k_sweep)) if kk != options.k}
    out.update({f"sd_conf{c:g}": dataclasses.replace(options, draft_confidence=c)
                for c in sorted(set(confidence_sweep)) if c != options.draft_confidence})
    return out


def _swept(method: str) -> tuple[str, float] | None:
    """(setting, value) of a swept method, None for the others (sd_chain is not sd_conf)."""
    for prefix, field in SWEPT.items():
        rest = method[len(prefix):]
        if method.startswith(prefix) and rest[:1].isdigit():
            return field, float(rest)
    return None


def _is_spec(method: str) -> bool:
    """Methods whose stats are kept (capture off only times capture; own AR's give the
    one-token forward the verify cost is measured against)."""
    return method in ("ar", "sd", "sd_eager", "sd_chain", "sd_torch_head") or _swept(method) is not None


def sweep_rows(runs: dict[str, MethodRun], stats: dict[str, SpecStats], field: str,
               own: float) -> list[dict[str, Any]]:
    """Per value of the swept `field` (the run's own `sd` at `own`, and each swept method):
    speed against own AR in the same run (total tokens over total time, and the median of
    per-prompt ratios), tokens per target step and acceptance."""
    names = {own: "sd"}
    for m in runs:
        swept = _swept(m)
        if swept is not None and swept[0] == field:
            names[swept[1]] = m
    ar = runs["ar"]
    rows = []
    for value in sorted(names):
        r, st = runs[names[value]], stats[names[value]]
        per_prompt = [(t / s) / (ta / sa) for t, s, ta, sa in zip(r.tokens, r.seconds, ar.tokens, ar.seconds)
                      if s and sa and ta]
        rows.append({field: int(value) if field == "k" else value,
                     "sd_vs_ar": r.tok_s / ar.tok_s if ar.tok_s else None,
                     "sd_vs_ar_median_per_prompt": statistics.median(per_prompt) if per_prompt else None,
                     "tokens_per_target_step": st.mean_accepted_len, "acceptance_rate": st.acceptance_rate})
    return rows


def time_methods(runners: dict[str, MethodFn], ids_list: list[list[int]], max_new_tokens: int,
                 log: Callable[[str], None], pinned: dict[str, str] | None = None
                 ) -> tuple[dict[str, MethodRun], dict[str, SpecStats], list[float]]:
    """Every method on every prompt; returns the runs, the merged speculative stats per method
    and, per prompt, (time with capture / time without) - 1. pinned: method -> the method it
    always runs right after (the rest rotate)."""
    from serve.engine.core import SpecStats

    # Warm-up: one short call per method (allocator, MKL/oneDNN kernels, HF caches).
    for fn in runners.values():
        fn(ids_list[0], 8)
    methods = tuple(runners)
    runs = {m: MethodRun() for m in methods}
    stats: dict[str, SpecStats] = {}
    capture_ratios: list[float] = []
    for i, ids in enumerate(ids_list):
        # Rotate the order per prompt so no method always runs first or last.
        order = methods[i % len(methods):] + methods[: i % len(methods)]
        for m, anchor in (pinned or {}).items():
            order = tuple(x for x in order if x != m)
            at = order.index(anchor) + 1
            order = order[:at] + (m,) + order[at:]
        for m in order:
            t0 = time.perf_counter()
            out, st, decode_s = runners[m](ids, max_new_tokens)
            dt = time.perf_counter() - t0
            runs[m].tokens.append(len(out))
            runs[m].seconds.append(dt)
            runs[m].outputs.append(out)
            if decode_s is not None:
                runs[m].decode_seconds.append(decode_s)
            if st is not None and _is_spec(m):
                stats.setdefault(m, SpecStats()).merge(st)
        capture_ratios.append(runs["sd"].seconds[-1] / runs["sd_nocapture"].seconds[-1] - 1.0)
        log(f"  [{i + 1}/{len(ids_list)}] {len(ids)} prompt tokens, "
            + ", ".join(f"{m} {runs[m].tokens[-1] / runs[m].seconds[-1]:.1f}" for m in methods) + " tok/s")
    return runs, stats, capture_ratios


def greedy_mismatches(runner: Any, runs: dict[str, MethodRun], ids_list: list[list[int]],
                      reference: str | None = None) -> list[dict[str, Any]]:
    """Where an own method's output first differs from HF generate's (own eager AR's without
    --no-hf; `reference` when given), with the target's top-2 logit gap there (a near tie
    explains a difference by float rounding)."""
    mismatches = []
    reference = reference or ("hf_ar" if "hf_ar" in runs else "ar_eager" if "ar_eager" in runs else "ar")
    for m in ("ar", "sd", "sd_nocapture", "ar_eager", "sd_eager", "sd_chain", "sd_torch_head",
              *sorted(r for r in runs if _swept(r))):
        if m == reference or m not in runs:
            continue
        for i, (ref, got) in enumerate(zip(runs[reference].outputs, runs[m].outputs)):
            pos = _first_diff(ref, got)
            if pos is not None:
                gap = _top2_gap(runner, ids_list[i] + ref[:pos]) if pos < len(ref) else None
                mismatches.append({"method": m, "prompt": i, "position": pos, "top2_logit_gap": gap,
                                   "reference": reference})
    return mismatches


def summarize(runs: dict[str, MethodRun], stats: dict[str, SpecStats], capture_ratios: list[float] | None,
              mismatches: list[dict[str, Any]], options: EngineOptions) -> dict[str, Any]:
    """The JSON figures; methods not run (HF under --no-hf, eager without graphs) give None."""
    sd_stats = stats["sd"]

    def tok(m: str) -> float | None:
        return runs[m].tok_s if m in runs and runs[m].tok_s else None

    def ratio(a: str, b: str) -> float | None:
        return tok(a) / tok(b) if tok(a) and tok(b) else None

    def stage_ms(st: SpecStats) -> dict[str, float]:
        return {n: 1e3 * t / max(st.num_steps, 1) for n, t in st.stage_s.items()}

    return {
        **{f"{m}_tok_s": tok(m) for m in METHODS + EAGER_METHODS + CHAIN_METHODS},
        "acceptance_rate": sd_stats.acceptance_rate,
        "mean_accepted_len": sd_stats.mean_accepted_len,
        "accepted_per_pos": sd_stats.accepted_per_pos,
        "num_drafts": sd_stats.num_drafts,
        "greedy_identical": not mismatches,
        "mismatches": mismatches,
        # Median over prompts of (time with capture / time without) - 1.
        "capture_overhead_pct": 100.0 * statistics.median(capture_ratios) if capture_ratios else None,
        "ar_vs_hf_ar": ratio("ar", "hf_ar"),
        "ar_vs_llamacpp": ratio("ar", "llamacpp"),
        "sd_vs_llamacpp": ratio("sd", "llamacpp"),
        "ar_vs_ar_float32": ratio("ar", "ar_float32"),
        "sd_vs_ar_float32": ratio("sd", "ar_float32"),
        "float32_agreement": float32_agreement(runs),
        # Information, not a check: llama.cpp computes with its own kernels (8-bit activations).
        "llamacpp_outputs_equal_own_ar": (sum(a == b for a, b in zip(runs["llamacpp"].outputs, runs["ar"].outputs))
                                          if "llamacpp" in runs else None),
        "sd_vs_hf_assisted": ratio("sd", "hf_assisted"),
        "sd_vs_ar": ratio("sd", "ar"),
        "sd_eager_vs_ar_eager": ratio("sd_eager", "ar_eager"),
        "ar_vs_ar_eager": ratio("ar", "ar_eager"),
        "median_tok_s": {m: r.median_tok_s for m, r in runs.items()},
        # Where a speculative step's time goes, in ms per step (prefill excluded).
        "sd_stage_ms_per_step": stage_ms(sd_stats),
        "sd_eager_stage_ms_per_step": stage_ms(stats["sd_eager"]) if "sd_eager" in stats else None,
        "sd_chain_stage_ms_per_step": stage_ms(stats["sd_chain"]) if "sd_chain" in stats else None,
        "chain_tokens_per_target_step": stats["sd_chain"].mean_accepted_len if "sd_chain" in stats else None,
        "sd_vs_sd_chain": ratio("sd", "sd_chain"),
        "sd_steps": sd_stats.num_steps,
        "k_policy": options.k_policy,
        "draft_confidence": options.draft_confidence,
        "tokens": {m: sum(r.tokens) for m, r in runs.items()},
        "seconds": {m: sum(r.seconds) for m, r in runs.items()},
    }


def draft_figures(st: SpecStats, runs: dict[str, MethodRun], draft: Any) -> dict[str, Any]:
    """Tokens per target step, acceptance per draft position (accepted / drafted there), one
    drafted token's time as a fraction of own AR's decode time per token (prefill excluded:
    the step a draft must beat), and for a head the share of the target's outputs inside its
    vocabulary."""
    import torch

    t_draft = st.stage_s["propose"] / max(st.num_draft_tokens, 1)
    ar_decode = runs["ar"].decode_tok_s
    t_step = 1.0 / ar_decode if ar_decode else None
    coverage = None
    draft = getattr(draft, "model", draft)  # head+suffix: the head's vocabulary
    if getattr(draft, "osd_family", None) == "head":
        t2d = draft.t2d().cpu()
        outs = torch.tensor([t for out in runs["ar"].outputs for t in out], dtype=torch.long)
        coverage = float(t2d[outs].float().mean()) if outs.numel() else None
    return {"tokens_per_target_step": st.mean_accepted_len,
            "acceptance_per_pos": [a / d if d else 0.0 for a, d in zip(st.accepted_per_pos, st.drafted_per_pos)],
            # Given every earlier draft accepted: comparable with a draft's offline agreement per depth.
            "acceptance_per_pos_given_prefix": [a / r if r else 0.0
                                                for a, r in zip(st.accepted_per_pos, st.reached_per_pos)],
            "draft_cost_per_token": t_draft / t_step if t_step and st.num_draft_tokens else None,
            "draft_vocab_coverage": coverage,
            "draft_vocab": int(draft.d2t.numel()) if coverage is not None else None,
            # Drafting steps by who proposed (head / suffix for head+suffix): acceptance, and
            # tokens emitted per such step (its accepted drafts plus the target's own token).
            "by_source": {src: {"steps": n, "drafted": d, "accepted": a, "acceptance": a / d if d else 0.0,
                                "tokens_per_step": (a + n) / n if n else 0.0}
                          for src, (n, d, a) in sorted(st.by_source.items())}}


def torch_head_engine(loaded: Any, draft: Any, options: EngineOptions) -> SpecEngine:
    """An engine whose head drafts through PyTorch (LeanHead) beside the same target."""
    from serve.engine.core import SpecEngine
    from serve.spec_decode.head.draft import torch_head_kernels

    if getattr(getattr(draft, "model", draft), "osd_family", None) != "head":
        raise ValueError("--vs-torch-head compares a head draft's kernels: give --draft head:init, "
                         "head+suffix or a head directory")
    with torch_head_kernels():
        return SpecEngine(loaded.model, draft, loaded.tokenizer, options)


def torch_head_figures(stats: dict[str, SpecStats], runs: dict[str, MethodRun], draft: Any) -> dict[str, Any]:
    """The head on PyTorch against the run's own (native) head, same prompts, interleaved: its
    speed against own AR, the native run's speed against it (median of per-prompt ratios),
    its draft cost per token and tokens per target step."""
    fig = draft_figures(stats["sd_torch_head"], runs, draft)
    sd, th, ar = runs["sd"], runs["sd_torch_head"], runs["ar"]
    per_prompt = [(t / s) / (tt / ts) for t, s, tt, ts in zip(sd.tokens, sd.seconds, th.tokens, th.seconds)
                  if s and ts and tt]
    return {"tok_s": th.tok_s, "vs_ar": th.tok_s / ar.tok_s if th.tok_s and ar.tok_s else None,
            "sd_vs_torch_head_median": statistics.median(per_prompt) if per_prompt else None,
            "draft_cost_per_token": fig["draft_cost_per_token"],
            "tokens_per_target_step": fig["tokens_per_target_step"], "by_source": fig["by_source"]}


def step_cost_figures(stats: dict[str, SpecStats], runs: dict[str, MethodRun]) -> dict[str, Any]:
    """The speculation arithmetic's inputs, measured in this run: own AR's decode speed and
    time per token without prefill, its one-token target forward, and the speculative run's
    verify forward by its actual token count T as a multiple of that one-token forward, V(T)."""
    ar, sd = stats.get("ar"), stats.get("sd")
    one = ar.score_by_tokens.get(1) if ar else None
    t1 = one[1] / one[0] if one and one[0] else None
    ar_decode = runs["ar"].decode_tok_s
    verify = {}
    if sd is not None and t1:
        verify = {str(t): {"steps": int(n), "ms": 1e3 * sec / n, "vs_one_token_forward": sec / n / t1}
                  for t, (n, sec) in sorted(sd.score_by_tokens.items()) if n}
    return {"ar_decode_tok_s": ar_decode,
            "ar_decode_ms_per_token": 1e3 / ar_decode if ar_decode else None,
            "one_token_forward_ms": 1e3 * t1 if t1 else None,
            "verify_cost_by_tokens": verify or None}


def self_draft_cost(runs: dict[str, MethodRun], k: int) -> dict[str, float]:
    """Ideal cost per emitted token with a perfect draft of the target's own cost:
    (one target forward + k draft steps) / (k + 1), both taken as own AR's time per token."""
    t_ar = sum(runs["ar"].seconds) / max(sum(runs["ar"].tokens), 1)
    ideal = (t_ar + k * t_ar) / (k + 1)
    per_tok = sum(runs["sd"].seconds) / max(sum(runs["sd"].tokens), 1)
    return {"self_ms_per_token": 1e3 * per_tok, "self_ideal_ms_per_token": 1e3 * ideal,
            "self_vs_ideal": per_tok / ideal}


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "x") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def _swept_label(method: str) -> str:
    field, value = _swept(method) or ("method", method)
    return f"own speculative, {'k' if field == 'k' else 'conf'}={value:g}"


def print_table(result: dict[str, Any], runs: dict[str, MethodRun], log: Callable[[str], None]) -> None:
    ref = "hf_ar" if "hf_ar" in runs else "ar_eager" if "ar_eager" in runs else "ar"
    base = runs[ref].tok_s
    log("")
    rows = [[LABELS.get(m) or _swept_label(m), sum(r.tokens), f"{sum(r.seconds):.1f}", f"{r.tok_s:.1f}",
             f"{r.median_tok_s:.1f}", f"{r.tok_s / base:.2f}x"]
            for m, r in runs.items() if r.tokens and sum(r.tokens)]  # HF assisted with a head draft: not run
    for line in tabulate(rows, headers=["method", "tokens", "seconds", "tok/s", "median", f"vs {ref}"],
                         disable_numparse=True, colalign=("left",) + ("right",) * 5).splitlines():
        log(line)
    log("")
    _log_references(result, log)
    _log_draft(result, log)
    _log_costs(result, log)
    _log_identity(result, ref, log)
    sys.stdout.flush()


def _log_references(result: dict[str, Any], log: Callable[[str], None]) -> None:
    """Own speculation and AR against the references: HF, llama.cpp, the float32 target, graphs."""
    log(f"acceptance rate {result['acceptance_rate']:.3f}, mean accepted length {result['mean_accepted_len']:.2f} "
        f"tokens/step, own AR / HF AR {_fmt(result['ar_vs_hf_ar'])}, own SD / HF assisted "
        f"{_fmt(result['sd_vs_hf_assisted'])}, own SD / own AR {_fmt(result['sd_vs_ar'])}")
    if result.get("sd_vs_llamacpp"):
        log(f"vs llama.cpp on the same GGUF: own SD {_fmt(result['sd_vs_llamacpp'])}, own AR "
            f"{_fmt(result['ar_vs_llamacpp'])}; its greedy output equals own AR's on "
            f"{result['llamacpp_outputs_equal_own_ar']} of {result['prompts']} prompts")
    if result.get("ar_vs_hf_mismatches") is not None:
        mm = result["ar_vs_hf_mismatches"]
        gaps = [m["top2_logit_gap"] for m in mm if m["top2_logit_gap"] is not None]
        log(f"own AR vs HF generate (information; each rounds the model its own way): {len(mm)} of "
            f"{result['prompts']} outputs differ" + (f", top-2 logit gaps there {[round(g, 3) for g in gaps]}" if gaps else ""))
    if result.get("float32_agreement"):
        agree = result["float32_agreement"]
        log(f"vs the float32 target: own AR {_fmt(result['ar_vs_ar_float32'])}, own SD "
            f"{_fmt(result['sd_vs_ar_float32'])}; greedy output equal on {agree['equal']} of {agree['prompts']} "
            f"prompts, first differences at {[d for d in agree['first_diff'] if d is not None]}")
    if result.get("ar_vs_ar_eager"):
        log(f"CUDA graphs: own AR graphs / eager {_fmt(result['ar_vs_ar_eager'])}, eager own SD / own AR "
            f"{_fmt(result['sd_eager_vs_ar_eager'])}")


def _log_draft(result: dict[str, Any], log: Callable[[str], None]) -> None:
    """What the draft did: acceptance per position, its cost, the head offline, by source."""
    log("acceptance per draft position: " + ", ".join(f"{a:.3f}" for a in result["acceptance_per_pos"])
        + "; given the earlier drafts accepted: "
        + ", ".join(f"{a:.3f}" for a in result["acceptance_per_pos_given_prefix"])
        + f"; draft cost per token {_fmt(result['draft_cost_per_token'], '.3f', '')} of a target step"
        + (f"; draft vocab coverage {result['draft_vocab_coverage']:.3f}" if result["draft_vocab_coverage"] else ""))
    if result.get("offline_agreement_per_depth"):
        log("the head offline (float32, the served runner's features, own AR's answers): greedy agreement per "
            "depth " + ", ".join(f"{a:.3f}" for a in result["offline_agreement_per_depth"])
            + f"; online acceptance / offline agreement at depth 1 "
            f"{_fmt(result['online_over_offline_depth1'], '.3f', '')}")
    for method, same in (result.get("depth1_same_rows") or {}).items():
        if same:
            log(f"{LABELS.get(method, method)}, depth 1 on the {same['rows']} rows it drafted from: online "
                f"{same['online']:.3f}, offline {same['offline']:.3f}, online / offline "
                f"{_fmt(same['online_over_offline'], '.3f', '')}")
    if len(result.get("by_source") or {}) > 1:
        log("by source: " + "; ".join(f"{src} {f['steps']} steps, acceptance {f['acceptance']:.3f}, "
                                      f"{f['tokens_per_step']:.2f} tokens/step"
                                      for src, f in result["by_source"].items()))


def _log_costs(result: dict[str, Any], log: Callable[[str], None]) -> None:
    """What the steps cost: capture, decode, verify by rows, trees, stages, the sweeps."""
    if result["capture_overhead_pct"] is None:  # a learning draft: capture off ran as a repeat
        log("capture overhead n/a: the capture-off run repeats each prompt after the captured one, whose "
            "answer the draft has learned (a full repeat)")
    else:
        log(f"capture overhead (median per prompt) {result['capture_overhead_pct']:+.2f}%")
    if result.get("ar_decode_tok_s"):
        log(f"own AR decode without prefill: {result['ar_decode_tok_s']:.1f} tok/s "
            f"({result['ar_decode_ms_per_token']:.1f} ms/token; one-token target forward "
            f"{_fmt(result['one_token_forward_ms'], '.1f', ' ms')})")
    if result.get("verify_cost_by_tokens"):
        log("verify forward by T, vs a one-token forward: " + ", ".join(
            f"V({t}) {v['vs_one_token_forward']:.2f} ({v['steps']} steps)"
            for t, v in result["verify_cost_by_tokens"].items()))
    if result.get("chain_tokens_per_target_step") is not None:
        log(f"tree {result['tree']}: {result['mean_accepted_len']:.2f} tokens/step vs chain "
            f"{result['chain_tokens_per_target_step']:.2f}; tree SD / chain SD {_fmt(result['sd_vs_sd_chain'])}")
    for key, label in (("sd_stage_ms_per_step", "speculative step"), ("sd_eager_stage_ms_per_step", "eager step"),
                       ("sd_chain_stage_ms_per_step", "chain step")):
        if result.get(key):
            log(f"{label}, ms per step: " + ", ".join(f"{n} {v:.2f}" for n, v in result[key].items()))
    th = result.get("torch_head")
    if th:
        log(f"head on PyTorch, same run: {_fmt(th['vs_ar'])} own AR, draft cost per token "
            f"{th['draft_cost_per_token'] or 0:.3f} of a target step, {th['tokens_per_target_step']:.2f} tokens/step; "
            f"own speculative / it {_fmt(th['sd_vs_torch_head_median'])} (median per prompt)")
    for key, field in (("k_sweep", "k"), ("confidence_sweep", "draft_confidence")):
        for row in result.get(key) or []:
            log(f"{field}={row[field]:g}: own SD / own AR {_fmt(row['sd_vs_ar'])} (median per prompt "
                f"{_fmt(row['sd_vs_ar_median_per_prompt'])}), {row['tokens_per_target_step']:.2f} tokens/step, "
                f"acceptance {row['acceptance_rate']:.3f}")
    if "self_vs_ideal" in result:
        log(f"draft=self: {result['self_ms_per_token']:.1f} ms/token vs ideal "
            f"{result['self_ideal_ms_per_token']:.1f} ms/token ({result['self_vs_ideal']:.2f}x)")


def _log_identity(result: dict[str, Any], ref: str, log: Callable[[str], None]) -> None:
    """Whether every own method's greedy output equals the reference's."""
    if result["greedy_identical"]:
        checked = result.get("greedy_reference") or ref
        log(f"greedy_identical: true (every own method's outputs equal {LABELS[checked]}'s on every prompt)")
    else:
        log(f"greedy_identical: false, {len(result['mismatches'])} outputs differ:")
        for mm in result["mismatches"]:
            log(f"  {mm['method']} prompt {mm['prompt']} position {mm['position']}: top-2 logit gap "
                f"{mm['top2_logit_gap']}")


# -- the command line: `osd bench engine` ------------------------------------------------------

HELP = "own AR and speculative decoding vs Hugging Face, one process"
ERRORS = (ValueError,)  # the user's to fix: the CLI prints the message and exits 2


def add_arguments(be: argparse.ArgumentParser) -> None:
    be.add_argument("--prompts", type=int, default=8, metavar="N", help="ShareGPT held-out prompts (default 8)")
    be.add_argument("--prompts-file", metavar="F", help="JSONL with a prompt field instead of ShareGPT")
    be.add_argument("--limit", type=int, metavar="N", help="use at most N prompts")
    be.add_argument("--max-new-tokens", type=int, default=96, metavar="M")
    be.add_argument("--k", type=int, default=4, metavar="K", help="draft tokens per step (default 4)")
    be.add_argument("--draft", default="truncate:4", metavar="SPEC", help="self, truncate:L, head:init (the warm-started head), suffix, head+suffix "
                         "(the warm-started head with the suffix draft, chosen per step), DIR+suffix, "
                         "or a published draft directory (default truncate:4)")
    be.add_argument("--workload", choices=("single", "multiturn"), default="single",
                    help="single: one user turn per prompt (or the file's conversations); multiturn: held-out "
                         "ShareGPT conversations' second turns after the target's own first answers")
    be.add_argument("--device", default="cpu", help="cpu or cuda")
    be.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                    help="CUDA graphs for decode/verify/draft steps (auto: on with --device cuda); when on, "
                         "the eager engine is timed in the same run")
    be.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="model dtype (default: model.dtype)")
    be.add_argument("--quant", choices=("none", "int4"), help="target weights (default: model.quant); int4 "
                                                             "implies --dtype bfloat16")
    be.add_argument("--k-policy", choices=("cost", "schedule", "fixed"), help="draft length per step "
                    "(default: serve.k_policy)")
    be.add_argument("--vs-float32", action="store_true", help="time own AR over the float32 target in the same run "
                    "and report where its greedy output first differs")
    be.add_argument("--vs-llamacpp", action="store_true", help="time llama.cpp on the GGUF the target comes from "
                    "in the same run (needs the optional llama-cpp-python)")
    be.add_argument("--k-sweep", nargs="+", type=positive_int, default=[], metavar="K",
                    help="also time these draft budgets in the same run, interleaved with own AR (e.g. 1 2 3)")
    be.add_argument("--confidence-sweep", nargs="+", type=probability_below_1, default=[], metavar="C",
                    help="also time these draft confidence stops (EngineOptions.draft_confidence) in the same run, "
                         "interleaved with own AR (e.g. 0.2 0.4)")
    be.add_argument("--tree", metavar="TOTAL,DEPTH,TOPK", help="verify EAGLE-2 draft trees (greedy); "
                                                                 "chains of the same draft are timed in the same run")
    be.add_argument("--no-hf", action="store_true", help="skip the Hugging Face methods (greedy identity is then "
                                                         "checked against own eager AR)")
    be.add_argument("--vs-torch-head", action="store_true",
                    help="also time the same head drafting through PyTorch instead of the native kernels, "
                         "interleaved (a head draft beside an int4 target on the CPU)")
    be.add_argument("--prefix-reuse", action="store_true",
                    help="let a request start from a prompt prefix a KV slot holds (serve.prefix_reuse). Off by "
                         "default: the methods run each prompt in turn on the same slots, so with it on a method "
                         "starts from the prefill the method before it did, and only the first pays it")
    be.add_argument("--target", help="target spec (default: model.target)")
    be.add_argument("--max-prompt-chars", type=int, default=1000, help="skip longer ShareGPT prompts")
    be.add_argument("--json", metavar="PATH", default="reports/bench/engine.json", help="where to write JSON")


def run(cfg: OSDConfig, args: argparse.Namespace) -> int:
    run_bench(cfg, n_prompts=args.prompts, prompts_file=args.prompts_file, limit=args.limit,
              max_new_tokens=args.max_new_tokens, k=args.k, draft_spec=args.draft, device=args.device,
              max_prompt_chars=args.max_prompt_chars, json_path=args.json, target=args.target,
              compile=args.compile, dtype=args.dtype, hf=not args.no_hf, tree=args.tree or "",
              k_sweep=args.k_sweep, confidence_sweep=args.confidence_sweep, quant=args.quant,
              vs_llamacpp=args.vs_llamacpp, k_policy=args.k_policy, vs_float32=args.vs_float32,
              workload=args.workload, vs_torch_head=args.vs_torch_head, prefix_reuse=args.prefix_reuse)
    return 0
