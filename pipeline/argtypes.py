"""argparse value types shared by the `osd` commands and the benches' own flags."""

from __future__ import annotations

import argparse


def positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {n}")
    return n


def fractions(value: str) -> tuple[float, ...]:
    """A comma list of fractions in (0, 1), for argparse."""
    try:
        out = tuple(float(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected fractions like 0.25,0.5, got {value!r}") from None
    if not all(0 < f < 1 for f in out):
        raise argparse.ArgumentTypeError(f"fractions must lie in (0, 1), got {value!r}")
    return out


def sizes(value: str) -> tuple[int, ...]:
    """A comma list of sizes >= 1, for argparse."""
    try:
        out = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes like 16,64, got {value!r}") from None
    if min(out) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be 1 or more, got {value!r}")
    return out


def positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {value}")
    return x


def probability_below_1(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not 0.0 <= x < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {x:g}")
    return x
