"""Continuous batching's decisions: which requests a step carries, and its prompt rows.

The scheduler holds the requests and decides; it runs nothing and calls nothing of the
engine. The engine's loop (serve/engine/core.py run_once) asks it for a plan, runs the plan
(serve/engine/step.py) and hands back what the step took:

    schedule() -> StepPlan   admits submitted requests, drops cancelled ones (their slots go
                             back here, after the last forward that wrote them); the prompt
                             prefixes new requests take from the slots (prefix.py); every
                             decoding request rides in the step, chains and trees alike; the
                             prompt chunks
    update(plan, took)       logs the forward, paces the prompt chunks, retires the finished
    fail(error)              a failed step fails the requests it carried, not the engine

Prompt chunks: requests still prefilling get chunks of up to `prefill_chunk` tokens, first
come first served, at most one chunk's rows a step; a lone prompt among running streams is
paced so a step that carries its chunk takes at most PREFILL_DELAY decode steps: a long
prompt slows the running streams by a bounded factor, never stalls them for a whole prefill
(with several prompts waiting, whole chunks; with no stream running, longer ones).
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from serve.engine.admission import SlotPool
from serve.engine.prefix import best_prefix
from serve.engine.sequence import NOTHING_HELD, Held, Seq, Slot
from serve.engine.stages import prefill_tokens

DONE = object()  # delivered after a request's last tokens
ALONE_CHUNKS = 8  # a prompt's chunk, in prefill_chunks, while no request decodes
PREFILL_DELAY = 2.0  # a step with a prompt chunk: at most this many decode steps' time
MIN_CHUNK = 8
EWMA_STEP = 0.2


@dataclass
class StepPlan:
    """One step's work: the decoding requests (each drafts and verifies, or decodes a row) and
    the prompt chunks (request, tokens) that ride beside them; first, the prompt prefixes new
    requests take: (request, the slot holding it, tokens), the request's own slot or another's."""
    decode: list[Seq]
    chunks: list[tuple[Seq, torch.Tensor]]
    prefixes: list[tuple[Seq, Slot, int]] = field(default_factory=list)


@dataclass
class StepTook:
    """What a step took, for the log and the pacing: the target forward's sequences and rows,
    the whole step's seconds, the tokens it emitted and its prompt rows."""
    sequences: int
    rows: int
    seconds: float
    emitted: int = 0
    prompt_rows: int = 0


class StepLog:
    """The target forwards of recent steps, for metrics, /osd/stats and the ops page: each
    (unix time, sequences in the forward, rows), plus running totals."""

    def __init__(self, maxlen: int = 8192):
        self.steps: collections.deque[tuple[float, int, int]] = collections.deque(maxlen=maxlen)
        self.total = 0
        self.rows = 0
        self.sequences = 0

    def add(self, sequences: int, rows: int) -> None:
        self.steps.append((time.time(), sequences, rows))
        self.total += 1
        self.rows += rows
        self.sequences += sequences

    def since(self, seen: int) -> list[tuple[float, int, int]]:
        """Steps after the first `seen` ever logged (those still kept)."""
        new = min(self.total - seen, len(self.steps))
        return list(self.steps)[len(self.steps) - new:] if new > 0 else []

    def series(self, bucket_s: float = 10.0) -> list[list[float]]:
        """[[bucket start, mean sequences per forward, mean rows per forward, forwards]]."""
        out: dict[float, list[float]] = {}
        for t, seqs, rows in list(self.steps):
            b = out.setdefault(t - t % bucket_s, [0.0, 0.0, 0.0])
            b[0] += seqs
            b[1] += rows
            b[2] += 1
        return [[t, s / n, r / n, n] for t, (s, r, n) in sorted(out.items())]

    def totals(self) -> dict[str, int]:
        return {"forwards": self.total, "rows": self.rows, "sequences": self.sequences}


def _usable(seq: Seq, held: Held) -> Sequence[int]:
    """The held tokens a request can take: none of another tenant's or cache salt's; for a
    draft that reads features, only as far as its own draft's cache rows over them reach, plus
    the one position computed again (best_prefix shrink)."""
    if held.scope != seq.reuse_scope:
        return ()
    if not seq.reads_features:
        return held.tokens
    return held.tokens[:seq.draft_rows(held) + 1]


class Scheduler:
    """The requests of one engine, and each step's plan (module doc). Thread-safe for submit
    and waiting; schedule, update and fail run under the engine's step lock."""

    def __init__(self, slots: SlotPool, prefill_chunk: int):
        self.slots = slots
        self.prefill_chunk = prefill_chunk
        self.prompt_tokens = 0  # of admitted requests
        self.cached_tokens = 0  # of those, taken from a slot (prefix.py)
        self._mu = threading.Lock()  # the incoming list
        self._incoming: list[Seq] = []
        self.active: list[Seq] = []
        self.log = StepLog()
        self.chunk = prefill_chunk  # paced (_pace) between MIN_CHUNK and prefill_chunk
        self.decode_s = 0.0  # recent seconds of a step without a prompt chunk

    def submit(self, seq: Seq) -> None:
        seq.progress = time.monotonic()
        with self._mu:
            self._incoming.append(seq)

    def waiting(self) -> list[Seq]:
        with self._mu:
            return self.active + self._incoming

    def schedule(self) -> StepPlan | None:
        """The next step's plan; None when no request is left to run."""
        with self._mu:
            new, self._incoming = self._incoming, []
        prefixes = self._prefixes([s for s in new if not s.cancelled])
        self.active += new
        self._retire(lambda s: s.cancelled)
        if not self.active:
            return None
        now = time.monotonic()
        for seq in self.active:
            seq.progress = now
        decode = [s for s in self.active if not s.prefilling]
        return StepPlan(decode, self._chunks([s for s in self.active if s.prefilling], len(decode)), prefixes)

    def update(self, plan: StepPlan, took: StepTook) -> None:
        """After a step: the log, the chunks' pacing, and the finished requests retired."""
        if took.sequences:
            self.log.add(took.sequences, took.rows)
        if plan.decode:
            self._pace(took.seconds, bool(plan.chunks))
        self._retire(lambda s: s.finish is not None or s.error is not None)

    def fail(self, error: BaseException) -> None:
        """A step raised: every request it was running fails with the error, and retires."""
        for seq in self.active:
            seq.error = error
        self._retire(lambda s: True)

    def _prefixes(self, new: list[Seq]) -> list[tuple[Seq, Slot, int]]:
        """The longest prompt prefix each new request can take from a slot (prefix.py): its own,
        a free one's, or a running request's committed positions (prompt chunks included), of
        a request of the same tenant and cache salt; not another new request's, which has
        computed nothing yet."""
        out: list[tuple[Seq, Slot, int]] = []
        held: list[tuple[Slot, Held]] | None = None  # gathered once, if a request may take a prefix
        for seq in new:
            self.prompt_tokens += seq.n_prompt
            own = seq.slot
            own_held = _usable(seq, own.held)
            own.held = NOTHING_HELD  # the request's now: its forwards overwrite the positions past its prefix
            if not (seq.may_reuse and seq.prefilling):
                continue
            if held is None:
                held = [(s.slot, s.holding()) for s in self.active]
                held += [(slot, slot.held) for slot in self.slots.idle() if slot.held.tokens]
            mine = [(slot, _usable(seq, h)) for slot, h in held]
            # A draft that reads features computes the last position of its prefix again: the
            # target's features there are its next row's input.
            reuse = best_prefix(seq.tokens[:seq.n_prompt], own, own_held, mine, shrink=int(seq.reads_features))
            if reuse is not None:
                seq.prefilled = seq.cached_tokens = reuse.tokens
                self.cached_tokens += reuse.tokens
                out.append((seq, reuse.source, reuse.tokens))
        return out

    def _retire(self, done) -> None:
        keep = []
        for seq in self.active:
            if not done(seq):
                keep.append(seq)
                continue
            seq.slot.held = seq.holding()  # for the next requests (prefix.py)
            self.slots.release(seq.slot)
            if seq.draft is not None:
                seq.draft.release(seq)  # a draft that keeps per-request state of its own
            seq.deliver(seq.error if seq.error is not None else DONE)
        self.active = keep

    def _pace(self, seconds: float, chunked: bool) -> None:
        """Size prompt chunks so a step that carries one takes at most PREFILL_DELAY times a
        step without: prompt rows are compute-bound on a CPU (a whole chunk beside a few decode
        rows takes several of their steps), so a fixed chunk would stall the streams."""
        if not chunked:
            self.decode_s += EWMA_STEP * (seconds - self.decode_s) if self.decode_s else seconds
        elif self.decode_s:
            ratio = seconds / self.decode_s
            scale = min(1.25, max(0.5, PREFILL_DELAY / ratio * 0.9))
            self.chunk = int(min(self.prefill_chunk, max(MIN_CHUNK, self.chunk * scale)))

    def _chunks(self, prefilling: list[Seq], decoding: int) -> list[tuple[Seq, torch.Tensor]]:
        """Whole chunks, first come first served, within one chunk's rows per step (at least
        one chunk, so every prompt advances). With nothing decoding, no stream waits on the
        prompt: chunks are ALONE_CHUNKS times prefill_chunk, for fewer passes over the weights."""
        out: list[tuple[Seq, torch.Tensor]] = []
        # Paced chunks while one prompt arrives among running streams; with more prompts
        # waiting, whole chunks: prefill throughput then decides how many requests decode at
        # all (paced 4-token chunks starved a 16-client load: 3 requests per forward).
        chunk = (self.prefill_chunk * ALONE_CHUNKS if not decoding
                 else self.chunk if len(prefilling) == 1 else self.prefill_chunk)
        budget = chunk
        for seq in prefilling:
            toks = prefill_tokens(seq, chunk)
            if out and toks.numel() > budget:
                break
            out.append((seq, toks))
            budget -= toks.numel()
            if budget <= 0:
                break
        return out
