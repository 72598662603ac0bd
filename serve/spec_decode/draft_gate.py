"""Whether a batched step drafts at all: measured, not modelled.

The cost rule (k_policy.py) sizes drafts from a profile of the target's forward by rows and
each draft's acceptance. Under load that model misses what a drafting step costs besides its
rows: the proposals' host work between forwards, the verify and commit of every chain, and
what that work does to the forward beside it (on 2 CPU cores, speculation's steps ran their
forward's rows 14% slower, docs/benchmarks.md). Served at 16 clients, speculation then lost
to plain decoding although the rule drafted under a tenth of a row a request.

So for batched steps the engine also measures the outcome: the step's tokens (emitted, plus
its prompt rows, each worth a token as in plan_batch) per second of the whole step, in steps
that may draft and in steps that do not. The two kinds alternate in blocks of BLOCK steps
until each has MIN_STEPS, so the machine's drift and the batch's make-up fall on both alike;
then the faster kind runs, and one block in EXPLORE runs the other, so a change (a draft that
starts to match, longer contexts) is seen. Kept per batch size (the decoding requests' count,
by powers of two): whether drafting pays at 2 requests says little about 16.

A request alone (the per-request rule) is not gated. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK = 4  # consecutive steps of one kind: a block outlasts the effect of the kind before it
EXPLORE = 8  # one block in this many runs the slower kind
MIN_STEPS = 16  # of each kind before the rates decide
DECAY = 0.98  # per observed step of a kind, of its accumulated tokens and seconds
MARGIN = 0.02  # drafting is held back only when plain steps are this much faster


@dataclass
class Rate:
    """Decayed sums of tokens and seconds of one kind of step."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: float, seconds: float) -> None:
        self.tokens = self.tokens * DECAY + tokens
        self.seconds = self.seconds * DECAY + seconds
        self.steps += 1

    @property
    def per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Bucket:
    drafting: Rate
    plain: Rate
    steps: int = 0

    @property
    def warm(self) -> bool:
        return min(self.drafting.steps, self.plain.steps) >= MIN_STEPS

    def drafting_pays(self) -> bool:
        return self.drafting.per_s * (1 + MARGIN) >= self.plain.per_s


class DraftGate:
    """Per engine: for each batched step, may it draft (module doc)."""

    def __init__(self) -> None:
        self.buckets: dict[int, Bucket] = {}

    @staticmethod
    def bucket(sequences: int) -> int:
        return max(sequences, 1).bit_length()

    def allow(self, sequences: int) -> bool:
        """This step's kind, for a step of `sequences` decoding requests."""
        b = self.buckets.setdefault(self.bucket(sequences), Bucket(Rate(), Rate()))
        block = b.steps // BLOCK
        b.steps += 1
        if not b.warm:
            return block % 2 == 0
        return b.drafting_pays() != (block % EXPLORE == EXPLORE - 1)

    def observe(self, sequences: int, drafting: bool, tokens: float, seconds: float) -> None:
        """A step that allow() decided: the tokens it made (emitted plus prompt rows) in `seconds`."""
        if seconds > 0:
            b = self.buckets[self.bucket(sequences)]
            (b.drafting if drafting else b.plain).add(tokens, seconds)

    def state(self) -> dict[str, dict[str, float]]:
        """Per bucket (its smallest batch size): tokens per second of each kind, and the steps seen."""
        return {str(1 << (k - 1)): {"drafting_tok_s": round(b.drafting.per_s, 1), "plain_tok_s": round(b.plain.per_s, 1),
                                    "drafting_steps": b.drafting.steps, "plain_steps": b.plain.steps}
                for k, b in sorted(self.buckets.items())}
