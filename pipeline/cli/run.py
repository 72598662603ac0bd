"""`osd serve`, `osd up` and `osd demo`: the serving stack, the closed loop, the demo."""

from __future__ import annotations

import argparse
import os

from infra.config import OSDConfig, load_config
from infra.drafts.spec import DRAFT_FAMILIES
from pipeline.argtypes import positive_int
from pipeline.cli.common import MODEL_HELP, model_flag


def _cmd_serve(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from pipeline.stack.launch import run_server

    updates = {k: v for k, v in (("host", args.host), ("port", args.port), ("num_replicas", args.replicas),
                                 ("draft", args.draft)) if v is not None}
    if updates or args.model:  # re-validated, so a bad flag fails like a bad config value
        cfg = load_config(args.config, overrides={"serve": updates, **model_flag(args)})
    return run_server(cfg, api_key=os.environ.get("OSD_API_KEY"))


def _cmd_up(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from pipeline.stack.up import run_up

    return run_up(cfg, train=not args.no_train)


def _cmd_demo(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from pipeline.traffic.demo import run_demo

    run_demo(cfg, general_s=args.general_seconds, code_s=args.code_seconds, speed_prompts=args.speed_prompts,
             max_tokens=args.max_tokens, concurrency=args.clients, out_dir=args.out, family=args.family)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
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
    demo.add_argument("--general-seconds", type=float, default=120, help="general traffic first (default 120)")
    demo.add_argument("--code-seconds", type=float, default=600, help="then code traffic (default 600)")
    demo.add_argument("--clients", type=positive_int, default=8,
                      help="concurrent clients sending the traffic, each one request at a time (default 8)")
    demo.add_argument("--speed-prompts", type=positive_int, default=48,
                      help="post-shift prompts for the AR comparison (the batched check sends the first 12)")
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument("--out", default="reports/demo", help="report directory (default reports/demo)")
    demo.add_argument("--family", choices=DRAFT_FAMILIES, default="head",
                      help="v1's draft family: head (`osd draft init --family head`, up to about 25 minutes once on "
                           "2 cores) or layer (`osd draft init`); built once and cached (default head)")
    demo.set_defaults(func=_cmd_demo)
