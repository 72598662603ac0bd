"""pipeline/ in rooms: the `osd` CLI lists every bench of pipeline/bench/, each bench owns its
flags, and parsing them loads no model library."""

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import pipeline.bench
from pipeline.cli import build_parser
from pipeline.cli.bench import BENCHES

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[1]
HELPERS = {"llamacpp", "adapt_head", "online_offline"}  # timed beside engine and forward; the head family of
# `osd bench adapt`; a head online against offline in `osd bench engine`


def test_every_bench_module_is_listed_and_owns_its_command_line():
    modules = {m.name for m in pkgutil.iter_modules(pipeline.bench.__path__)} - HELPERS
    assert set(BENCHES) == modules
    for name, bench in BENCHES.items():
        assert bench.HELP and isinstance(bench.ERRORS, tuple), name
        assert callable(bench.add_arguments) and callable(bench.run), name
        args = build_parser().parse_args(["bench", name])
        assert args.func.args == (bench,)  # the CLI calls the bench's own run


def test_the_cli_parses_without_loading_a_model_library():
    code = ("import sys; from pipeline.cli import build_parser; build_parser().parse_args(['bench', 'engine']); "
            "print(sorted(m for m in ('torch', 'transformers', 'ray', 'deepspeed', 'pyarrow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_python_dash_m_pipeline_cli_is_the_osd_command():
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: osd")
    for verb in ("config", "models", "data", "bench", "replay", "draft", "train", "serve", "up", "demo", "registry",
                 "records"):
        assert verb in out.stdout
