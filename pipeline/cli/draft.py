"""`osd draft init | vocab-study | curve` and `osd train`: make the first draft offline, study
draft vocabularies and budgets, and run the trainer group on the record stream."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from infra.config import OSDConfig, load_config
from infra.drafts.spec import DRAFT_FAMILIES, DraftSpecError
from pipeline.argtypes import fractions, positive_float, positive_int
from pipeline.cli.common import MODEL_HELP, model_flag, user_error


def draft_init_config(cfg: OSDConfig, args: argparse.Namespace) -> OSDConfig:
    """The config with `osd draft init`'s flags applied, re-validated like the file's values."""
    flags = {"warm_teacher": args.teacher, "warm_prompt_chars": args.prompt_chars, "device": args.device}
    if args.family == "head":
        flags.update(head_warm_epochs=args.epochs, head_warm_prompts=args.prompts, head_warm_max_new_tokens=args.max_new_tokens,
                     head_warm_turns=args.turns, head_warm_budget_minutes=args.budget_minutes)
    else:
        flags.update(warm_epochs=args.epochs, warm_prompts=args.prompts, warm_max_new_tokens=args.max_new_tokens,
                     warm_turns=args.turns, warm_budget_minutes=args.budget_minutes)
    updates = {k: v for k, v in flags.items() if v is not None}
    model = {"device": args.device} if args.device else {}  # the target generates where the draft trains
    model.update(model_flag(args).get("model", {}))
    return load_config(args.config, overrides={"train": updates, "model": model}) if updates or model else cfg


def _cmd_draft_init(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from pipeline.teacher.engine import teacher_for
    from train.warm.layer import run_warm_start

    cfg = draft_init_config(cfg, args)
    if args.family == "head":
        from train.warm.head import run_head_warm_start
        from train.teacher.features import TeacherDataError

        try:
            result = run_head_warm_start(cfg, out_dir=args.out, force=args.force, draft_vocab=args.draft_vocab,
                                         conversations=args.conversations, generate=teacher_for(cfg),
                                         curve=args.curve)
        except TeacherDataError as e:
            return user_error(e)
        print(json.dumps({k: result.get(k) for k in ("path", "alpha_est_before", "alpha_est", "coverage")}, indent=2))
        return 0
    result = run_warm_start(cfg, out_dir=args.out, force=args.force, generate=teacher_for(cfg))
    print(json.dumps({k: result.get(k) for k in ("version", "path", "alpha_est_before", "alpha_est")}, indent=2))
    return 0


def _cmd_draft_vocab_study(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from infra.drafts.spec import warm_start_path
    from pipeline.studies.vocab_study import StudyError, parse_eval_files, run_vocab_study
    from train.distill.draft_vocab import VocabError

    if args.max_new_tokens is not None:
        cfg = load_config(args.config, overrides={"train": {"warm_max_new_tokens": args.max_new_tokens}})
    draft = args.draft if args.draft != "none" else None
    if args.draft is None:  # today's head, when `osd draft init` made one: the baseline to beat
        draft = warm_start_path(cfg, "head") if (warm_start_path(cfg, "head") / "draft.json").is_file() else None
    try:
        run_vocab_study(cfg, per_domain=args.prompts, held_per_domain=args.held_out, sizes=args.sizes,
                        eval_files=parse_eval_files(args.eval_file), draft=draft, json_path=args.json,
                        budget_s=args.budget_minutes * 60 if args.budget_minutes else None)
    except (StudyError, VocabError) as e:
        return user_error(e)
    return 0


def _cmd_draft_curve(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from pipeline.studies.draft_curve import CurveError, draft_curve

    try:
        draft_curve(args.drafts, args.json, None if args.png == "none" else args.png)
    except CurveError as e:
        return user_error(e)
    return 0


def _cmd_train(cfg: OSDConfig, args: argparse.Namespace) -> int:
    import ray

    from infra.redis.server import resolve_redis_url
    from pipeline.teacher.served_forward import served_forward
    from train.online.family import NO_HEAD_INIT
    from train.online.trainer import run_with_restarts, save_stats

    if args.family == "head" and not args.init_draft:
        raise DraftSpecError(NO_HEAD_INIT)  # before Ray starts: every worker would refuse it
    overrides: dict = {"stream": {"redis_url": resolve_redis_url(cfg)}}
    if args.workers:
        overrides["train"] = {"num_workers": args.workers}
    cfg = load_config(args.config, overrides=overrides)
    run_dir = Path(args.run_dir or Path(cfg.state_dir) / "train" / "run")
    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=True,
             ignore_reinit_error=True)
    stats = run_with_restarts(cfg, run_dir, init_draft=args.init_draft, family=args.family, served=served_forward,
                              max_records=args.max_records,
                              max_seconds=args.max_seconds, idle_stop_s=args.idle_stop)
    save_stats(stats, run_dir / "stats.json")
    for s in stats:
        print(f"rank {s.rank}: {s.steps} steps, {s.records_trained} records, {s.tokens} tokens, "
              f"{len(s.exports)} candidates")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """osd draft init / vocab-study / curve and osd train."""
    dr_p = sub.add_parser("draft", help="draft models")
    dr_sub = dr_p.add_subparsers(dest="action", required=True, metavar="ACTION")
    di = dr_sub.add_parser("init", help="warm start: distill the first draft offline from the target's outputs")
    di.add_argument("--prompts", type=int, help="ShareGPT train prompts the target answers (default "
                                               "train.head_warm_prompts: 1536; layer: train.warm_prompts: 256)")
    di.add_argument("--epochs", type=int, help="passes over the training data (default train.head_warm_epochs, "
                                               "train.warm_epochs for layer)")
    di.add_argument("--max-new-tokens", type=int, help="teacher tokens per prompt (default "
                                                      "train.head_warm_max_new_tokens: 128; layer: train.warm_max_new_tokens: 64)")
    di.add_argument("--teacher", choices=("engine", "hf", "batch"),
                    help="who writes the teacher answers: the serving engine, continuously batched in the "
                         "serving weight format, Hugging Face generate, or batch: static batches with the head's "
                         "features captured, what --device cuda uses (default train.warm_teacher: engine)")
    di.add_argument("--model", metavar="PATH", help=MODEL_HELP)
    di.add_argument("--out", help="where to publish (default <state_dir>/drafts/head-v1, or v1 for layer)")
    di.add_argument("--force", action="store_true", help="rebuild even if published; ignore checkpoints")
    di.add_argument("--family", choices=DRAFT_FAMILIES, default="head",
                    help="head: one layer over the target's hidden states (out <state_dir>/drafts/head-v1; "
                         "up to about 25 minutes on 2 cores: 12 of answers, then training); layer: copied target "
                         "layers (out <state_dir>/drafts/v1) (default head)")
    di.add_argument("--conversations", type=int,
                    help="head: ShareGPT train conversations as fixed text (default none)")
    di.add_argument("--draft-vocab", type=int, help="head: draft vocabulary size V_d (default 8192)")
    di.add_argument("--budget-minutes", type=positive_float, metavar="N",
                    help="stop teacher generation after N minutes and train on what the cache holds; a later run "
                         "generates only the prompts still missing (default train.head_warm_budget_minutes: 12; "
                         "layer: train.warm_budget_minutes: none)")
    di.add_argument("--device", choices=("cpu", "cuda"),
                    help="where the target generates and the head trains (default train.device: cpu); cuda: "
                         "static batches of 1024 prompts, features kept in GPU memory")
    di.add_argument("--turns", choices=("first", "all"),
                    help="ShareGPT human turns used as prompts: each conversation's first, or every turn alone "
                         "(default train.head_warm_turns: all; layer: train.warm_turns: first)")
    di.add_argument("--prompt-chars", type=int, metavar="N",
                    help="the longest prompt in characters (default train.warm_prompt_chars: 600)")
    di.add_argument("--curve", type=fractions, default=(), metavar="F,F,...",
                    help="head: after the head, one more per fraction in (0, 1), trained on that fraction of the "
                         "answers (a smaller budget of this run), saved as <out>-at-<F> for `osd draft curve`")
    di.set_defaults(func=_cmd_draft_init)
    _add_vocab_study_parser(dr_sub)
    dc = dr_sub.add_parser("curve", help="held-out agreement against warm-start tokens over heads made at growing "
                                         "budgets (JSON and PNG under reports/)")
    dc.add_argument("drafts", nargs="+", metavar="DIR", help="published head draft directories")
    dc.add_argument("--json", default="reports/bench/head-curve.json", help="where to write JSON")
    dc.add_argument("--png", default="reports/bench/head-curve.png", help="where to draw it (none: no plot)")
    dc.set_defaults(func=_cmd_draft_curve)

    tr = sub.add_parser("train", help="run the trainer group on the record stream")
    tr.add_argument("--workers", type=int, help="trainer actors (default train.num_workers)")
    tr.add_argument("--init-draft", help="published draft directory to start from (default: a fresh layer "
                    "draft); a head draft's directory trains a head")
    tr.add_argument("--family", choices=DRAFT_FAMILIES,
                    help="refuse to start unless the init draft is of this family (default: the init draft's)")
    tr.add_argument("--run-dir", help="checkpoints and candidates (default <state_dir>/train/run)")
    tr.add_argument("--max-records", type=int)
    tr.add_argument("--max-seconds", type=float)
    tr.add_argument("--idle-stop", type=float, help="stop after this many seconds without records")
    tr.set_defaults(func=_cmd_train)


def _add_vocab_study_parser(dr_sub: argparse._SubParsersAction) -> None:
    vs = dr_sub.add_parser("vocab-study", help="coverage of the target's own answers by draft vocabularies of "
                                               "8k/16k/24k, per domain (table; JSON under reports/vocab)")
    vs.add_argument("--prompts", type=positive_int, default=64, metavar="N",
                    help="train-split ShareGPT prompts per domain that choose the vocabularies (default 64)")
    vs.add_argument("--held-out", type=positive_int, default=32, metavar="N",
                    help="held-out ShareGPT prompts per domain that measure them (default 32)")
    vs.add_argument("--eval-file", action="append", default=[], metavar="NAME=PATH",
                    help="a JSONL of prompts from elsewhere, measured as domain NAME (repeatable), e.g. "
                         "reasoning=reports/vocab/prompts-reasoning.jsonl")
    vs.add_argument("--sizes", type=positive_int, nargs="+", default=[8192, 16384, 24576], metavar="V",
                    help="draft vocabulary sizes (default 8192 16384 24576)")
    vs.add_argument("--draft", metavar="DIR", help="a head draft whose own vocabulary to measure too (default: "
                                                   "the warm-started head if there is one; none: skip)")
    vs.add_argument("--max-new-tokens", type=positive_int, metavar="M",
                    help="answer tokens per prompt (default train.warm_max_new_tokens, sharing draft init's cache)")
    vs.add_argument("--budget-minutes", type=positive_float, metavar="N", help="stop generating after N minutes")
    vs.add_argument("--json", metavar="PATH", default="reports/vocab/study.json", help="where to write JSON")
    vs.set_defaults(func=_cmd_draft_vocab_study)
