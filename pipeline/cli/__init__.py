"""The `osd` command: a thin layer over the functions the tests call.

One module per command group, each with `add_parsers(sub)`: info (config, models, data),
bench (lists the benches of pipeline/bench/, which own their flags), replay, draft (draft
init / vocab-study / curve, train), run (serve, up, demo), registry and records. `main` loads
the config and turns the errors that are the user's to fix into one line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from infra.config import ConfigError, OSDConfig, load_config
from infra.drafts.spec import DraftSpecError
from infra.prompts import PromptDataError
from infra.redis.server import RedisServerError
from infra.registry import RegistryError
from infra.target import TargetError
from pipeline.cli import bench, draft, info, records, registry, replay, run
from pipeline.cli.common import user_error
from pipeline.stack.launch import LaunchError
from pipeline.stack.up import UpError
from serve.engine.errors import EngineError, RequestError

# Errors that are the user's to fix: print the message, exit 2, no traceback. Each comes from a
# module that imports no model library, so naming them costs the CLI nothing at start-up.
USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, TargetError, PromptDataError, RegistryError,
                                            RedisServerError, DraftSpecError, EngineError, RequestError,
                                            LaunchError, UpError)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="osd",
        description="Online speculative decoding: serve, record, distill, roll out.",
    )
    p.add_argument("--config", metavar="FILE", help="YAML config (default: built-in defaults; also $OSD_CONFIG)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (info, bench, replay, draft, run, registry, records):  # the order `osd --help` lists them
        group.add_parsers(sub)
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
        return user_error(e)
    except KeyboardInterrupt:
        print("osd: interrupted", file=sys.stderr)
        return 130


__all__ = ["USER_ERRORS", "build_parser", "main"]
