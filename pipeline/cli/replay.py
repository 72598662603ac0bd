"""`osd replay`: prompts against an OpenAI-compatible endpoint, summarised (pipeline/traffic/replay.py)."""

from __future__ import annotations

import argparse

from infra.config import OSDConfig
from pipeline.cli.common import user_error


def _cmd_replay(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from infra.prompts import select_prompts
    from pipeline.traffic.replay import ReplayError, run_replay

    try:
        prompts = select_prompts(cfg.data, args.prompts, args.prompts_file, args.split, args.domain,
                                 args.max_prompt_chars)
        url = args.url or f"http://{cfg.serve.host}:{cfg.serve.port}"
        record = None if args.record is None else args.record == "on"
        run_replay(cfg, url, prompts=prompts, concurrency=args.concurrency, rate=args.rate,
                   max_tokens=args.max_tokens, temperature=args.temperature, chat=not args.completions,
                   record=record, timeout_s=args.timeout, progress=not args.no_progress, json_path=args.json,
                   compare_recording=args.compare_recording, duration_s=args.duration, seed=args.seed)
    except ReplayError as e:
        return user_error(e)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
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
