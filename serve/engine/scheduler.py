"""Continuous batching: one target forward per step for every active request.

Each step (run by whoever waits for it: Scheduler's doc):
1. admits submitted requests and drops cancelled ones (their slots go back here, after the
   last forward that wrote them);
2. gives prompt chunks: requests still prefilling get chunks of up to `prefill_chunk`
   tokens, first come first served, at most one chunk's rows a step; a lone prompt among
   running streams is paced so a step that carries its chunk takes at most PREFILL_DELAY
   decode steps: a long prompt slows the running streams by a bounded factor, never stalls
   them for a whole prefill (with several prompts waiting, whole chunks; with no stream
   running, longer ones);
3. sizes each decoding request's draft (the engine's plan: for the cost rule, the lengths
   with the most expected tokens per second over the whole batch, serve/spec_decode/k_policy.py);
4. drafts for each request, through the Draft protocol (serve/spec_decode/protocol.py): the requests of one
   draft together (a head drafts them in one forward per draft position);
5. runs one target forward over every request's rows (serve/model/batch_forward.py);
6. verifies and commits per request, as a request alone does, and delivers its tokens.
A request the batch cannot carry (a draft tree; on a GPU, a request decoding alone) steps alone
in the same loop.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from typing import Any

import torch

from infra.records.tokens import topk_logprobs
from serve.model.batch_forward import Item, forward_batch
from serve.engine.sequence import Seq
from serve.engine.stages import commit, end_prefill, prefill_tokens, prefilled_chunk, verify
from serve.sampling.verify import verify_greedy

DONE = object()  # delivered after a request's last tokens
ALONE_CHUNKS = 8  # a prompt's chunk, in prefill_chunks, while no request decodes
PREFILL_DELAY = 2.0  # a step with a prompt chunk: at most this many decode steps' time
MIN_CHUNK = 8
EWMA_STEP = 0.2


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


class Scheduler:
    """Steps run on the threads that wait for them, one at a time (`run_once` under a lock): a
    blocking caller (generate) steps in its own thread until its request is done; streams
    step on their event loop, in a driver task that yields to the loop between steps.

    Why not a thread of its own: libgomp gives every thread that starts parallel regions its
    own worker team, and spins a team's workers only while the process has no more OpenMP
    threads than cores. A second team (a stepping thread beside the thread that loaded the
    model) makes every parallel op wait on a sleeping worker, so a decode forward on a second
    thread ran far slower (docs/benchmarks.md). Ray Serve
    constructs a replica and runs its async methods on one thread, its user-code event loop,
    so stepping on the loop keeps the process at one team. A step blocks that loop for one
    forward; the replica serves nothing but its engine's requests."""

    def __init__(self, engine: Any, prefill_chunk: int):
        self.engine = engine
        self.prefill_chunk = prefill_chunk
        self._mu = threading.Lock()  # the incoming list
        self._stepping = threading.Lock()  # one round at a time, whoever drives it
        self._incoming: list[Seq] = []
        self._drivers: dict[int, asyncio.Task] = {}  # event loop id -> its driver task
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

    def run_once(self) -> bool:
        """One round: admit the submitted requests, drop the cancelled ones, step, retire the
        finished. False when there was nothing to run."""
        with self._stepping:
            with self._mu:
                self.active += self._incoming
                self._incoming.clear()
            self._retire(lambda s: s.cancelled)
            if not self.active:
                return False
            try:
                with self.engine.step_threads():
                    self.step(self.active)
            except Exception as e:  # a failed forward fails the requests it carried, not the engine
                for seq in self.active:
                    seq.error = e
            self._retire(lambda s: s.finish is not None or s.error is not None)
            return True

    def ensure_driver(self) -> None:
        """A task on the running event loop that steps while there is work."""
        loop = asyncio.get_running_loop()
        task = self._drivers.get(id(loop))
        if task is None or task.done():
            # Finished drivers go (each asyncio.run is a new loop): the map holds live loops only.
            self._drivers = {k: t for k, t in self._drivers.items() if not t.done()}
            self._drivers[id(loop)] = loop.create_task(self._drive())

    async def _drive(self) -> None:
        while self.run_once():
            await asyncio.sleep(0)  # deliver tokens, admit requests, serve cancellations

    def _retire(self, done) -> None:
        keep = []
        for seq in self.active:
            if not done(seq):
                keep.append(seq)
                continue
            self.engine.slots.release(seq.slot)
            if seq.draft is not None:
                seq.draft.release(seq)  # a draft that keeps per-request state of its own
            seq.deliver(seq.error if seq.error is not None else DONE)
        self.active = keep

    # -- one step ---------------------------------------------------------------

    def step(self, seqs: list[Seq]) -> None:
        eng = self.engine
        now = time.monotonic()
        for seq in seqs:
            seq.progress = now
        decoding = [s for s in seqs if not s.prefilling]
        batch = []
        for seq in decoding:
            if eng.batchable(seq, len(decoding)):
                batch.append(seq)
            else:
                seq.deliver(eng._step(seq))
        eng.begin_step()
        chunks = self._chunks([s for s in seqs if s.prefilling], len(decoding))
        if not batch and not chunks:
            return
        t_step = time.perf_counter()
        ks = eng.plan(batch, sum(t.numel() for _, t in chunks))
        props = eng.propose_all(batch, ks)
        items = [Item(torch.cat([s.pending(s.slot.target), p.tokens]), s.slot.target) for s, (p, _) in zip(batch, props)]
        items += [Item(toks, s.slot.target, logits=False) for s, toks in chunks]
        layers = _feature_layers(batch + [s for s, _ in chunks])
        t1 = time.perf_counter()
        outs = forward_batch(eng.target, items, layers, pool=eng.gpu)
        t2 = time.perf_counter()
        rows = sum(it.tokens.numel() for it in items)
        topks = _capture_topk(batch, [lg for lg, _ in outs[:len(batch)]])
        reads = _greedy_reads(batch, [p.tokens for p, _ in props], [lg for lg, _ in outs[:len(batch)]], eng.gpu)
        for seq, (p, draft_s), (logits, feats), topk, read in zip(batch, props, outs, topks, reads):
            seq.step_feats = _pick(feats, layers, _reads(seq))
            t3 = time.perf_counter()
            if read is not None:
                n, nxt = verify_greedy(*read)
                drafted = read[0].tolist()
            else:
                n, nxt = verify(seq, p.tokens, p.q, logits, p.point_mass)
                drafted = p.tokens.tolist()
            emitted = commit(seq, drafted, p.own, logits, n, nxt, topk)
            eng.after_step(seq, p.tokens.numel(), n, rows, draft_s, t2 - t1, time.perf_counter() - t3)
            seq.deliver(emitted)
        for (seq, toks), (_, feats) in zip(chunks, outs[len(batch):]):
            prefilled_chunk(seq, toks.numel(), _pick(feats, layers, _reads(seq)))
            if not seq.prefilling:
                end_prefill(seq)
                seq.t_decode = time.perf_counter()
        if batch:
            eng.observe_forward(len(items), rows, t2 - t1)
        self.log.add(len(batch) + len(chunks), rows)
        if batch:
            self._pace(time.perf_counter() - t_step, bool(chunks))

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


def _capture_topk(batch: list[Seq], logits: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Each capturing request's top-k (ids, log-probs) over its logit rows, computed for the
    whole step in one call when several capture with one top_k (one topk and one logsumexp
    over [rows, V] instead of one pair per request); None where a request computes its own."""
    want = [i for i, s in enumerate(batch) if s.capture is not None]
    ks = {batch[i].capture.top_k for i in want}
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(batch)
    if len(want) < 2 or len(ks) != 1:
        return out
    ids, lps = topk_logprobs(torch.cat([logits[i] for i in want]), ks.pop())
    lo = 0
    for i in want:
        t = logits[i].shape[0]
        out[i], lo = (ids[lo:lo + t], lps[lo:lo + t]), lo + t
    return out


def _greedy_reads(batch: list[Seq], drafts: list[torch.Tensor], logits: list[torch.Tensor],
                  device: bool) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """On a GPU, what greedy verify reads of every greedy request without processors, (drafts,
    the target's argmax per row) on the host, in one device-to-host copy for the whole step
    instead of a few syncs per request; None for the others (and on the CPU), which verify as
    a request alone does."""
    want = [i for i, s in enumerate(batch) if device and s.params.sampling.greedy and s.proc is None]
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(batch)
    if not want:
        return out
    parts = [t for i in want for t in (drafts[i], logits[i].argmax(-1))]
    host = torch.cat(parts).cpu().split([t.numel() for t in parts])
    for j, i in enumerate(want):
        out[i] = (host[2 * j], host[2 * j + 1])
    return out


def _reads(seq: Seq) -> tuple[int, ...]:
    """The target layers the request's draft reads features of (none for most drafts)."""
    return seq.draft.feature_layers if seq.draft is not None else ()


def _feature_layers(seqs: list[Seq]) -> tuple[int, ...]:
    """Every layer a draft in the step reads (drafts of one family read the same)."""
    return tuple(sorted({i for s in seqs for i in _reads(s)}))


def _pick(feats: torch.Tensor | None, have: tuple[int, ...], want: tuple[int, ...]) -> torch.Tensor | None:
    """The columns of `want` layers out of features of `have` layers, concatenated."""
    if feats is None or not want:
        return None
    if have == want:
        return feats
    width = feats.shape[-1] // len(have)
    return torch.cat([feats[:, have.index(i) * width:(have.index(i) + 1) * width] for i in want], dim=-1)
