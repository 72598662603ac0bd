"""What several `osd` command groups share: the --model flag and the user-error exit."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MODEL_HELP = ("the target: a GGUF file or a Hugging Face directory of Llama, Mistral, Qwen2 or Qwen3 (other "
              "directories run on the generic runner) (default model.target)")


def model_flag(args: argparse.Namespace) -> dict:
    """--model PATH (a GGUF file or a Hugging Face directory) as a config override of model.target."""
    model = getattr(args, "model", None)  # callers may build their own Namespace without it
    return {"model": {"target": str(Path(model).expanduser().resolve())}} if model else {}


def user_error(message: object) -> int:
    """A mistake the user can fix: one line on stderr, exit status 2, no traceback."""
    print(f"osd: error: {message}", file=sys.stderr)
    return 2
