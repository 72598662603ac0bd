"""Progress of teacher generation: tokens generated, tokens/s and the ETA.

One bar spans the whole generation stage, every cache shard and every batch in it: a bar per
chunk would restart its rate and ETA each time. The total is an upper bound (prompts x
max_new_tokens) that shrinks as answers end at EOS. Rate and ETA come from an injectable
clock, so they are tested without timing anything; tqdm only draws the line.
"""

from __future__ import annotations

import time
from typing import Any, Callable


def _clock_fmt(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


class TokenProgress:
    """Counts finished answers' tokens against the bound of `prompts` answers of up to
    `max_new_tokens` each. budget_s: the ETA never goes past what is left of it, since
    generation stops there (train/teacher/store.py)."""

    def __init__(self, prompts: int, max_new_tokens: int, *, clock: Callable[[], float] = time.monotonic,
                 budget_s: float | None = None, show: bool = True, desc: str = "teacher", file: Any = None):
        if prompts < 0 or max_new_tokens < 1:
            raise ValueError(f"need prompts >= 0 and max_new_tokens >= 1, got {prompts} and {max_new_tokens}")
        self.max_new_tokens = max_new_tokens
        self.bound = prompts * max_new_tokens
        self.tokens = 0
        self.answers = 0
        self.budget_s = budget_s
        self._clock = clock
        self._t0 = clock()
        self._bar = None
        if show:
            from tqdm import tqdm

            self._bar = tqdm(total=self.bound, unit="tok", unit_scale=True, desc=desc, file=file, leave=False,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} tok "
                                        "[{elapsed}{postfix}]")
            self._bar.set_postfix_str(self.postfix(), refresh=False)

    def answer(self, n_tokens: int) -> None:
        """One finished answer of n_tokens: they count as done, its unused tokens leave the bound."""
        if not 0 <= n_tokens <= self.max_new_tokens:
            raise ValueError(f"an answer has 0 to {self.max_new_tokens} tokens, got {n_tokens}")
        self.tokens += n_tokens
        self.answers += 1
        self.bound -= self.max_new_tokens - n_tokens
        if self._bar is not None:
            self._bar.total = self.bound
            self._bar.set_postfix_str(self.postfix(), refresh=False)
            self._bar.update(n_tokens)

    def elapsed_s(self) -> float:
        return self._clock() - self._t0

    def rate(self) -> float | None:
        """Generated tokens per second so far; None before the first token."""
        dt = self.elapsed_s()
        return self.tokens / dt if self.tokens and dt > 0 else None

    def eta_s(self) -> float | None:
        """Seconds until the bound is reached at the rate so far, or the budget ends if sooner."""
        rate = self.rate()
        eta = (self.bound - self.tokens) / rate if rate else None
        if self.budget_s is not None:
            left = max(0.0, self.budget_s - self.elapsed_s())
            eta = left if eta is None else min(eta, left)
        return eta

    def postfix(self) -> str:
        rate = self.rate()
        return f"{rate:.0f} tok/s, ETA {_clock_fmt(self.eta_s())}" if rate else f"ETA {_clock_fmt(self.eta_s())}"

    def summary(self) -> str:
        rate = self.rate()
        return (f"{self.tokens} tokens in {self.answers} answers, {self.elapsed_s():.0f} s"
                + (f", {rate:.0f} tok/s" if rate else ""))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
