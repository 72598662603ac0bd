"""Prompt prefixes whose keys and values a KV slot already holds.

Chat prompts share their beginnings: every request of a chat template starts with the same
system turn, and a conversation's next turn resends the whole conversation before it. A
slot's target cache keeps the keys and values of the tokens its last request committed
until a new request overwrites them, and a running request's committed positions never
change. So a new prompt can start from the longest prefix any slot holds: its own slot's
(nothing to copy), a free slot's or a running request's (the positions are copied, which is
far cheaper than computing them: serve/engine/step.py). vLLM's automatic prefix caching and
llama-server's prompt cache give the same: the same keys and values, computed once.

A prefix is taken only up to the prompt's last token but one: the last one is the first
token the request decodes from, so its logits come from the request's own forward.

No framework imports: unit-tested without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Iterable, Sequence, TypeVar

S = TypeVar("S")

_STRIDE = 64  # tokens compared at a time: a slice comparison runs in C


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """The length of a's and b's common prefix, at most `limit`."""
    n = min(len(a), len(b), limit)
    at = 0
    while at < n:
        end = min(at + _STRIDE, n)
        if list(a[at:end]) != list(b[at:end]):
            while a[at] == b[at]:
                at += 1
            return at
        at = end
    return n


@dataclass(frozen=True)
class Reuse(Generic[S]):
    """A prompt's first `tokens` positions, taken from `source`'s cache (the request's own
    slot where `source` is it)."""
    source: S
    tokens: int


def best_prefix(prompt: Sequence[int], own: S, own_held: Sequence[int],
                others: Iterable[tuple[S, Sequence[int]]], shrink: int = 0) -> Reuse[S] | None:
    """The longest prefix of `prompt` (short of its last token) that a slot holds: `own` (the
    request's slot, holding `own_held`) or one of `others` (slot, the tokens it holds), less
    `shrink` tokens. Ties go to the request's own slot, which needs no copy. None when no slot
    holds more than `shrink` tokens of it."""
    limit = len(prompt) - 1
    best = Reuse(own, common_prefix(prompt, own_held, limit))
    for slot, held in others:
        if best.tokens >= limit:
            break
        n = common_prefix(prompt, held, limit)
        if n > best.tokens:
            best = Reuse(slot, n)
    return Reuse(best.source, best.tokens - shrink) if best.tokens > shrink else None
