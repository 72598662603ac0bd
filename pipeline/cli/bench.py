"""`osd bench ACTION`: each bench module (pipeline/bench/) owns its flags (`add_arguments`) and
its run (`run(cfg, args)`); this only lists them and turns their user errors into exit 2."""

from __future__ import annotations

import argparse
import functools
from types import ModuleType

from infra.config import OSDConfig
from pipeline.bench import adapt, batch, engine, forward, load, soak, stream, teacher, train
from pipeline.cli.common import user_error

# In the order `osd bench --help` lists them.
BENCHES: dict[str, ModuleType] = {"engine": engine, "train": train, "adapt": adapt, "stream": stream,
                                  "forward": forward, "load": load, "batch": batch, "teacher": teacher,
                                  "soak": soak}


def _run(bench: ModuleType, cfg: OSDConfig, args: argparse.Namespace) -> int:
    try:
        return bench.run(cfg, args)
    except bench.ERRORS as e:
        return user_error(e)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    bench_p = sub.add_parser("bench", help="benchmarks (print a table, write JSON)")
    bench_sub = bench_p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, bench in BENCHES.items():
        p = bench_sub.add_parser(name, help=bench.HELP)
        bench.add_arguments(p)
        p.set_defaults(func=functools.partial(_run, bench))
