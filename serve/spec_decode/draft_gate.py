"""Whether a batched step drafts at all: measured, not modelled.

The cost rule (k_policy.py) sizes drafts from a profile of the target's forward by rows and
each draft's acceptance. Under load that model misses what a drafting step costs besides its
rows: the proposals' host work between forwards, the verify and commit of every chain, and
what that work does to the forward beside it (on 2 CPU cores, speculation's steps ran their
forward's rows 14% slower, docs/benchmarks.md). Served at 16 clients, speculation then lost
to plain decoding although the rule drafted under a tenth of a row a request.

So for batched steps the engine also measures the outcome: the tokens a step emitted per
second of the whole step, in blocks of BLOCK steps that may draft and blocks that may not.
Each block is compared with the block of the other kind next to it in time, and the gate keeps
a decayed mean of those pairs' log ratios: on 2 shared cores the machine's speed drifts by
10-20% within seconds, so rates of the two kinds gathered at different times (the running kind's
recent steps against the other kind's last exploring block) would compare the drift, not the
kinds. The kinds alternate until MIN_PAIRS pairs; then the faster kind runs, and one block in
EXPLORE runs the other (two pairs: the blocks before and after it), so a change (a draft that
starts to match, longer contexts) is seen. Each exploring block that leaves the choice as it
was doubles the blocks to the next one, up to EXPLORE_MAX; a new choice starts again at
EXPLORE. Exploring runs the slower kind, so with drafting 10% slower at 16 requests one block
in 8 cost 1.25% of the tokens, and one in 32 costs 0.3%; a change now shows within about two
explorations, at most 2 x EXPLORE_MAX blocks. Steps that carry prompt rows are not counted: a
prompt chunk costs up to a few decode steps' time (the scheduler's pacing), so which kind
happened to carry the chunks would decide (counted with their prompt rows as tokens, one served
run read drafting steps 1.4x plain ones at 8-15 requests where they had drafted nothing;
docs/benchmarks.md). Kept per batch size (the decoding requests' count, by powers of two):
whether drafting pays at 2 requests says little about 16.

A request alone (the per-request rule) is not gated. Pure: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

BLOCK = 4  # consecutive steps of one kind: a block outlasts the effect of the kind before it
EXPLORE = 8  # one block in this many runs the slower kind, after a new choice
EXPLORE_MAX = 32  # ... and at most this many blocks apart while the choice holds
MIN_PAIRS = 8  # adjacent blocks of the two kinds compared before the gate decides
PAIR_DECAY = 0.9  # per pair, of the accumulated log ratios
DECAY = 0.98  # per observed step of a kind, of the rates shown (state())
MARGIN = 0.02  # drafting is held back only when plain steps are this much faster


@dataclass
class Rate:
    """Decayed sums of tokens and seconds of one kind of step."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: float, seconds: float, decay: float = DECAY) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds
        self.steps += 1

    @property
    def per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Block:
    """A block of one kind: the tokens and seconds of its counted steps."""

    drafting: bool
    rate: Rate = field(default_factory=Rate)


@dataclass
class Bucket:
    drafting: Rate = field(default_factory=Rate)  # shown
    plain: Rate = field(default_factory=Rate)
    steps: int = 0  # allow() calls
    block: Block | None = None  # in progress
    last: Block | None = None  # the last finished block with counted steps
    log_ratio: float = 0.0  # decayed sum over pairs of log(drafting rate / plain rate)
    pair_weight: float = 0.0  # the same decayed sum of 1 a pair: log_ratio / pair_weight is the mean
    paired: int = 0  # pairs compared
    choice: bool | None = None  # the faster kind as last judged (None until warm)
    explore_every: int = EXPLORE  # blocks from one exploring block to the next
    since: int = 0  # blocks since the last exploring one (or the choice)
    explored: int = 0  # exploring blocks run

    @property
    def warm(self) -> bool:
        return self.paired >= MIN_PAIRS

    def drafting_pays(self) -> bool:
        return self.log_ratio / self.pair_weight >= -math.log1p(MARGIN)

    def next_kind(self) -> bool:
        """The kind of the block that starts now (whether it drafts)."""
        if not self.warm:
            return self.steps // BLOCK % 2 == 0
        pays = self.drafting_pays()
        if pays != self.choice:  # a new choice: explore at the base rate again
            self.choice, self.explore_every, self.since = pays, EXPLORE, 0
        self.since += 1
        if self.since < self.explore_every:
            return pays
        self.since, self.explored = 0, self.explored + 1
        self.explore_every = min(2 * self.explore_every, EXPLORE_MAX)  # back to EXPLORE if it flips the choice
        return not pays

    def finish_block(self) -> None:
        done, self.block = self.block, None
        if done is None or done.rate.seconds <= 0 or done.rate.tokens <= 0:
            return
        last, self.last = self.last, done
        if last is None or last.drafting == done.drafting:
            return
        drafting, plain = (done, last) if done.drafting else (last, done)
        self.log_ratio = self.log_ratio * PAIR_DECAY + math.log(drafting.rate.per_s / plain.rate.per_s)
        self.pair_weight = self.pair_weight * PAIR_DECAY + 1.0
        self.paired += 1


class DraftGate:
    """Per engine: for each batched step, may it draft (module doc)."""

    def __init__(self) -> None:
        self.buckets: dict[int, Bucket] = {}

    @staticmethod
    def bucket(sequences: int) -> int:
        return max(sequences, 1).bit_length()

    def allow(self, sequences: int) -> bool:
        """This step's kind, for a step of `sequences` decoding requests."""
        b = self.buckets.setdefault(self.bucket(sequences), Bucket())
        if b.steps % BLOCK == 0:
            b.finish_block()
            b.block = Block(b.next_kind())
        b.steps += 1
        assert b.block is not None
        return b.block.drafting

    def observe(self, sequences: int, drafting: bool, emitted: float, prompt_rows: int, seconds: float) -> None:
        """A step that allow() decided: the tokens it emitted in `seconds`, beside `prompt_rows`
        prompt rows (a step with any is not counted: module doc)."""
        b = self.buckets.get(self.bucket(sequences))
        if b is None or seconds <= 0 or prompt_rows:
            return
        (b.drafting if drafting else b.plain).add(emitted, seconds)
        if b.block is not None and b.block.drafting == drafting:
            b.block.rate.add(emitted, seconds, 1.0)

    def state(self) -> dict[str, dict[str, float]]:
        """Per bucket (its smallest batch size): tokens per second of each kind lately, the
        steps seen, and the paired estimate of drafting's rate over plain decoding's."""
        return {str(1 << (k - 1)): {"drafting_tok_s": round(b.drafting.per_s, 1), "plain_tok_s": round(b.plain.per_s, 1),
                                    "drafting_steps": b.drafting.steps, "plain_steps": b.plain.steps,
                                    "drafting_vs_plain": round(math.exp(b.log_ratio / b.pair_weight), 3) if b.pair_weight else None,
                                    "pairs": b.paired, "explored": b.explored, "explore_every": b.explore_every}
                for k, b in sorted(self.buckets.items())}
