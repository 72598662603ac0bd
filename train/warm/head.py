"""`osd draft init --family head`: the first head draft, distilled offline.

1. Data: the warm start's teacher records (the target's greedy answers, train/warm/layer.py's
   cache) plus ShareGPT conversations as fixed text (human and assistant turns, train split):
   these need only a target prefill for their features, no generation, so they add far more
   tokens for the same minutes.
2. Features: the teacher records' were captured while the serving engine generated them
   (train/teacher/features.py, kept in the teacher cache); the rest (ShareGPT text, and
   teacher records from a generator that captures none: Hugging Face) take one no-grad
   target forward per batch (train/distill/head.py), cached on disk under
   state_dir/head-features keyed by target, data and layers, so a rerun skips it.
3. Draft vocabulary: the V_d most frequent target argmax tokens of the training data; the
   coverage of held-out teacher outputs is reported for several V_d.
4. Training: the unrolled loss (depth 3, 0.8^j) through the DistillEngine; evaluation on the
   held-out teacher records, unrolled on the head's own state; saved as a draft directory.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any, Literal

import torch

from infra.config import OSDConfig


CONV_CHUNK = 40
# Padded feature rows per optimizer step of the head's warm start. Optimizer steps, not rows,
# limited the heads measured so far (docs/benchmarks.md, "Every human turn, and a GPU"): large
# GPU steps gave too few of them. So the GPU's is 8x the steps of 16384 rows, each cheap there.
TOKEN_BUDGET = 512
CUDA_TOKEN_BUDGET = 2048


def _log(msg: str) -> None:
    print(f"[osd draft init --family head] {msg}", flush=True)


def conversation_ids(cfg: OSDConfig, tokenizer: Any, n: int, max_len: int) -> list[list[int]]:
    """Chat-template ids of the first n train-split ShareGPT conversations, cut to max_len."""
    from infra.prompts import conversation_messages, sharegpt_conversations

    out = []
    for _, msgs in conversation_messages(sharegpt_conversations(), cfg.data, split="train", limit=n):
        ids = tokenizer.apply_chat_template(msgs, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)[:max_len]
        if len(ids) >= 8:
            out.append(ids)
    return out


def cached_features(cfg: OSDConfig, loaded: Any, name: str, seqs: list[list[int]], starts: list[int] | None,
                    layers: tuple[int, ...], progress: bool):
    """compute_features, from state_dir/head-features when this exact input was done before."""
    from infra.drafts.layer import target_ref
    from train.distill.head import FeatureSet, compute_features

    key = hashlib.sha256(json.dumps({"target": target_ref(loaded)["sha256"], "seqs": seqs, "starts": starts,
                                     "layers": layers}).encode()).hexdigest()[:20]
    path = Path(cfg.state_dir) / "head-features" / f"{name}-{key}.pt"
    if path.is_file():
        try:
            return FeatureSet(**torch.load(path, weights_only=True))
        except Exception as e:  # a torn or foreign file: rebuilt below
            _log(f"feature cache {path} unreadable ({e}); recomputing")
    total, done, t0 = sum(len(s) for s in seqs), [0], time.perf_counter()

    def tick(n: int) -> None:
        done[0] += n
        if progress:
            rate = done[0] / (time.perf_counter() - t0)
            _log(f"{name} features: {done[0]}/{total} tokens ({rate:.0f} tok/s)")

    fs = compute_features(loaded.model, seqs, layers, starts=starts, progress=tick)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(fs.__dict__, tmp)
    tmp.replace(path)
    return fs


def run_head_warm_start(cfg: OSDConfig, *, out_dir: str | Path | None = None, progress: bool = True,
                        force: bool = False, conversations: int | None = None, max_len: int = 512,
                        draft_vocab: int | None = None, feature_layers: tuple[int, ...] | None = None,
                        epochs: int | None = None, token_budget: int | None = None,
                        generate: Any = None, curve: tuple[float, ...] = ()) -> dict[str, Any]:
    """Teacher records + ShareGPT fixed text -> target features -> a trained head (module doc).
    The prompts, their answers' length and turns are train.head_warm_prompts,
    head_warm_max_new_tokens and head_warm_turns (OSDConfig.for_warm_start);
    conversations (ShareGPT ones as fixed text) default to none, epochs to head_warm_epochs;
    generate: the teacher's generator (train.teacher.data.BatchGenerate; default Hugging Face).
    With model.device cuda the target generates there in static batches (train/teacher/batch.py)
    and the head trains there; token_budget defaults to TOKEN_BUDGET, or CUDA_TOKEN_BUDGET on
    CUDA. curve: fractions in (0, 1); after the head, one more head
    per fraction, trained on that fraction of this run's answers (the first ones made, as a
    smaller budget would have), saved beside it as `<out>-at-<fraction>` for `osd draft curve`."""
    if not all(0 < f < 1 for f in curve):
        raise ValueError(f"curve fractions must lie in (0, 1), got {list(curve)}")
    from infra.drafts.head import feature_layers_of, top_tokens
    from infra.drafts.spec import DraftSpec, warm_start_path
    from infra.target import load_target
    from train.distill.head import coverage_curve
    from train.teacher.sets import batch_teacher, on_cuda

    cfg = cfg.for_warm_start("head")
    tc = cfg.train
    out_dir = Path(out_dir) if out_dir else warm_start_path(cfg, "head")
    if out_dir.exists() and not force:
        _log(f"{out_dir} already exists (use --force to rebuild)")
        info = json.loads((out_dir / "draft.json").read_text())
        return {"path": str(out_dir), **info.get("metrics", {}), **info.get("lineage", {})}
    t0 = time.perf_counter()
    loaded = load_target(cfg.model.target, cfg.model.for_training(), progress=progress)
    batched = batch_teacher(cfg, loaded)
    if batched is not None:
        generate = batched
        _log(f"target on {cfg.model.device}: teacher answers in static batches of {batched.batch_size}")
    if token_budget is None:
        token_budget = CUDA_TOKEN_BUDGET if on_cuda(loaded) else TOKEN_BUDGET
    torch.manual_seed(0)
    spec = DraftSpec(family="head", feature_layers=feature_layers, draft_vocab=draft_vocab or DraftSpec().draft_vocab)
    layers = feature_layers_of(spec, loaded.model.config.num_hidden_layers)
    conversations = conversations or 0
    epochs = epochs or tc.head_warm_epochs
    fs_train, fs_held, n_conv = _features(cfg, loaded, layers, conversations, max_len, progress, generate)
    if not len(fs_held) or not len(fs_train):
        from train.teacher.features import TeacherDataError

        raise TeacherDataError(f"{len(fs_train)} training and {len(fs_held)} held-out teacher records (one in "
                         f"train.held_out_every={tc.held_out_every} is held out): answer more prompts (--prompts), "
                         f"or a larger --budget-minutes")
    train_am = torch.cat(fs_train.argmax)
    held_am = torch.cat([a[s + 1:] for a, s in zip(fs_held.argmax, fs_held.start)])
    vocab = loaded.model.config.vocab_size
    coverage = coverage_curve(train_am, held_am, vocab)
    _log("coverage of held-out target outputs by V_d: " + ", ".join(f"{k}: {v:.3f}" for k, v in coverage.items()))
    vocab_counts = draft_vocab_counts(cfg, loaded, train_am, generate=generate, progress=progress)
    lineage = {"parent": None, "kind": "warm_start", "family": "head", "conversations": n_conv,
               "teacher_records": len(fs_train) - n_conv, "epochs": epochs, "vocab_source": "warm_data"}
    fit = _Fit(cfg, loaded, spec, fs_held, epochs, token_budget, force)
    metrics = fit(fs_train, top_tokens(vocab_counts, spec.draft_vocab), out_dir, lineage,
                  {"coverage_curve": {str(k): v for k, v in coverage.items()}})
    _log(f"saved {out_dir} ({time.perf_counter() - t0:.0f} s in all)")
    for frac in curve:  # smaller budgets of this run: its first answers, in the order the store made them
        sub = _prefix(fs_train, frac)
        at = out_dir.with_name(f"{out_dir.name}-at-{frac:g}")
        counts = torch.bincount(torch.cat(sub.argmax), minlength=vocab)  # the vocabulary that budget would choose
        fit(sub, top_tokens(counts, spec.draft_vocab), at, {**lineage, "teacher_records": len(sub)},
            {"curve_of": str(out_dir)})
        _log(f"curve point {frac:g}: saved {at} ({time.perf_counter() - t0:.0f} s in all)")
    return {"path": str(out_dir), **metrics, **lineage}


class _Fit:
    """Build, train, evaluate and save a head on one feature set: the warm start's head, and
    each curve point's (the same held-out set, epochs and batches)."""

    def __init__(self, cfg: OSDConfig, loaded: Any, spec: Any, fs_held: Any, epochs: int, token_budget: int,
                 force: bool):
        self.cfg, self.loaded, self.spec, self.fs_held = cfg, loaded, spec, fs_held
        self.epochs, self.token_budget, self.force = epochs, token_budget, force

    def __call__(self, fs_train: Any, d2t: torch.Tensor, out_dir: Path, lineage: dict, extra: dict) -> dict:
        from infra.drafts.head import build_head, save_head
        from infra.drafts.layer import target_ref
        from train.distill.head import evaluate

        head = build_head(self.loaded.model, self.spec, d2t)
        before = evaluate(head, self.fs_held)
        losses, train_s = _train(self.cfg, head, self.loaded.model, fs_train, self.epochs, self.token_budget)
        after = evaluate(head, self.fs_held)
        _log(f"held-out greedy agreement per depth {[round(a, 3) for a in before['agree_per_depth']]} -> "
             f"{[round(a, 3) for a in after['agree_per_depth']]}; tokens/step estimate "
             f"{after['tokens_per_step_est']:.2f} ({fs_train.n_tokens} training tokens)")
        metrics = {"alpha_est": after["alpha_est"], "alpha_est_before": before["alpha_est"],
                   "agree_per_depth": after["agree_per_depth"], "tokens_per_step_est": after["tokens_per_step_est"],
                   "coverage": after["coverage"], **extra, "loss_last": losses[-1] if losses else None,
                   "held_out_records": len(self.fs_held), "train_tokens": fs_train.n_tokens, "train_s": train_s}
        save_head(head, out_dir, target_ref=target_ref(self.loaded), lineage=lineage, metrics=metrics,
                  overwrite=self.force)
        return metrics


def _prefix(fs: Any, frac: float) -> Any:
    """The first ceil(frac * n) sequences of a FeatureSet (views, no copies)."""
    from train.distill.head import FeatureSet

    n = max(1, math.ceil(frac * len(fs)))
    return FeatureSet(fs.ids[:n], fs.feats[:n], fs.final[:n], fs.argmax[:n], fs.start[:n])


def draft_vocab_counts(cfg: OSDConfig, loaded: Any, train_argmax: torch.Tensor, *, generate: Any = None,
                       progress: bool = True, pool: list | None = None,
                       source: Literal["warm_data", "teacher_domains"] = "warm_data",
                       per_domain: int = 64) -> torch.Tensor:
    """[V] what the draft vocabulary is the top of: the target argmax counts of the training
    data ("warm_data", what the warm start uses), or, for the vocabulary study's alternative,
    with them the target's answers to `per_domain` train prompts of each ShareGPT domain, each
    source's frequencies weighted alike ("teacher_domains"; they were the settings
    train.head_vocab_source and head_vocab_prompts). pool: ShareGPT prompts already loaded (tests)."""
    from infra.prompts import DOMAINS, load_sharegpt
    from train.distill.draft_vocab import pooled_frequencies, token_counts
    from train.teacher.sets import split_held_out, teacher_records, warm_prompts

    tc, vocab = cfg.train, loaded.model.config.vocab_size
    counts = torch.bincount(train_argmax, minlength=vocab)
    if source == "warm_data":
        return counts
    pool = load_sharegpt(cfg.data, split="train") if pool is None else pool
    prompts = [p for d in DOMAINS for p in warm_prompts(cfg, per_domain, domain=d, prompts=pool)]
    # Held-out ids stay out of the choice too: the warm start measures the head on them.
    recs, _ = split_held_out(teacher_records(cfg, loaded, prompts, progress=progress, generate=generate),
                             tc.held_out_every)
    sources = {"warm_data": counts.numpy()}
    for d in DOMAINS:
        c = token_counts([r.output_ids for r in recs if r.domain == d], vocab)
        if c.sum():
            sources[d] = c
    _log(f"draft vocabulary from {', '.join(sources)}, each weighted alike")
    return torch.from_numpy(pooled_frequencies(sources))


def _features(cfg: OSDConfig, loaded: Any, layers: tuple[int, ...], conversations: int, max_len: int,
              progress: bool, generate: Any = None):
    """(train FeatureSet: teacher train records + conversations, held-out teacher FeatureSet, n conversations)."""
    from train.gate.evaluator import is_held_out
    from train.teacher.sets import teacher_answers, warm_budget_s, warm_prompts

    tc = cfg.train
    prompts = warm_prompts(cfg, tc.warm_prompts)
    filled = teacher_answers(cfg, loaded, prompts, progress=progress, generate=generate, budget_s=warm_budget_s(cfg),
                             feature_layers=layers)
    pairs = list(zip(filled.records, filled.features))
    held = [p for p in pairs if is_held_out(p[0].request_id, tc.held_out_every)]
    train = [p for p in pairs if not is_held_out(p[0].request_id, tc.held_out_every)]
    fs_train = teacher_feature_set(cfg, loaded, "teacher-train", train, layers, progress)
    fs_held = teacher_feature_set(cfg, loaded, "teacher-held", held, layers, progress)
    convs = conversation_ids(cfg, loaded.tokenizer, conversations, max_len) if conversations else []
    for i in range(0, len(convs), CONV_CHUNK):  # cached by chunk: more conversations reuse the first ones
        fs_train.extend(cached_features(cfg, loaded, "sharegpt", convs[i:i + CONV_CHUNK], None, layers, progress))
    _log(f"training on {fs_train.n_tokens} tokens ({len(train)} teacher records, {len(convs)} ShareGPT "
         f"conversations); {len(held)} held-out teacher records")
    return fs_train, fs_held, len(convs)


def teacher_feature_set(cfg: OSDConfig, loaded: Any, name: str, pairs: list, layers: tuple[int, ...], progress: bool):
    """The FeatureSet of teacher records, from (record, its captured FeatureRows or None) pairs:
    captured rows as they are (an answer's last token has none: train/teacher/features.py),
    the others through cached_features' forward pass."""
    from train.distill.head import FeatureSet

    fs = FeatureSet()
    rest = [r for r, f in pairs if f is None]
    for r, f in pairs:
        if f is not None:
            fs.ids.append(f.ids)
            fs.feats.append(f.feats)
            fs.final.append(f.final)
            fs.argmax.append(f.argmax)
            fs.start.append(max(len(r.prompt_ids) - 2, 0))  # compute_features' start of the same record
    if rest:
        fs.extend(cached_features(cfg, loaded, name, [[int(t) for t in r.prompt_ids] + [int(t) for t in r.output_ids]
                                                      for r in rest], [len(r.prompt_ids) for r in rest], layers,
                                  progress))
    if pairs:
        _log(f"{name}: features of {len(pairs) - len(rest)} records captured during generation, "
             f"{len(rest)} computed")
    return fs


def _train(cfg: OSDConfig, head: Any, target: Any, fs_train: Any, epochs: int,
           token_budget: int) -> tuple[list[float], float]:
    """Epochs of the unrolled loss through the DistillEngine. Small batches (`token_budget`):
    with tens of thousands of tokens, the number of optimizer steps is what limits the head."""
    from infra.redis.server import free_port
    from train.distill.ds_engine import DistillEngine, autocast_dtype, init_distributed
    from train.distill.head import head_loss_fn, train_epochs

    tc = cfg.train
    init_distributed(0, 1, "127.0.0.1", free_port(), tc.device)
    engine = DistillEngine(head, tc, autocast=autocast_dtype("auto", tc.device))
    t = time.perf_counter()
    losses = train_epochs(engine, fs_train, head_loss_fn(target.lm_head.weight.detach()), epochs=epochs,
                          token_budget=token_budget, log=_log)
    weights = engine.export_weights()
    with torch.no_grad():
        params = dict(head.named_parameters())
        for n, w in weights.items():
            params[n].copy_(w)
    return losses, time.perf_counter() - t
