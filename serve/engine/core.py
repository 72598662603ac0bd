"""The speculative decoding engine.

One step is a chain of named stages, each a module-level function that can be timed alone
(serve/engine/stages.py):

    prefill  -> propose -> score -> verify -> commit
    (chunks)    draft:     target:  pure      accept tokens, roll both KV caches back,
                k tokens   k+1 rows rule      record the target's top-k

Requests run together: the scheduler plans each step (serve/engine/scheduler.py), and the
step (serve/engine/step.py) runs one target forward over every active request's rows, chains
and draft trees alike, on any device (serve/model/batch_forward.py); the other stages run
per request.

Autoregressive decoding is the same loop with no draft (k = 0), so the baseline and the
speculative path share every line that is not speculation.

KV convention: a sequence's cache holds every committed token except the last one, which
is the first input of the next forward. After verify, each cache is truncated to the
committed prefix, so rollback is a length change (see runner.StaticKVCache).

Draft length: at most k tokens per step (config `serve.k`), chosen per step by `k_policy`:
- cost (the serving default, serve/spec_decode/k_policy.py): the length in 0..k with the most expected
  tokens per second, from the target's forward cost by token count (profiled at the first
  speculative step, then measured from every step), the draft's measured cost per token,
  and the request's running acceptance; in a batch, the lengths with the most expected
  tokens per second over the whole batch (plan_batch), so drafting shrinks as load grows. A draft that cannot pay for its verify drafts
  nothing but a probe token now and then (after 16 idle steps, doubling after each rejected
  probe), so speculation never costs much more than AR.
- schedule: the budget grows by 2 after a step whose drafts were all accepted and shrinks
  by 1 (not below 1) otherwise, the rule of Hugging Face's default assistant schedule.
- fixed: k every step.
And a confidence stop, for experiments: drafting stops when the draft's top probability at the
next position falls below EngineOptions.draft_confidence (0, serving's, disables it). Decided
before drawing, so sampled drafts still follow q and verification stays exact.
Neither can change the output, only the cost. Never past the token budget or the context.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, AsyncIterator, Iterator, Sequence

import torch
from pydantic import ValidationError

from infra.config import ModelConfig, ServeConfig
from infra.records.tokens import eos_token_ids
from serve.engine.admission import SlotPool
from serve.model.batch_forward import Item, forward_batch
from serve.engine.capture import Capture, CaptureBuffer
from serve.engine.detokenize import StopScanner
from serve.spec_decode.protocol import Draft, StepContext
from serve.engine.errors import EngineError, RequestError  # noqa: F401 (re-exported)
from serve.spec_decode.k_policy import LengthPolicy, length_policy, profile_forward
from serve.sampling.processors import LogitsProcessor
from serve.model.linear import QUANT_MODES
from serve.model.runner import LlamaRunner, Runner
from serve.model.native_runner import NativeLlamaRunner
from serve.model.factory import make_runner
from serve.spec_decode.factory import as_draft, draft_runner
from serve.model.cuda_graphs import GraphLlamaRunner, StagingRing
from serve.engine.scheduler import DONE, Scheduler
from serve.engine.sequence import GenerationParams, Seq, Slot, SpecStats  # noqa: F401 (re-exported)
from serve.engine.stages import begin_prefill, end_prefill
from serve.engine.step import run_step
from serve.spec_decode.trees.stages import TreeShape


DEFAULT: Any = object()  # "the engine's own draft" for the per-request draft= argument
# Prompt rows a GPU step takes at least (serve.prefill_chunk where larger): a GPU forward is
# launch-bound up to about this many rows, so a step's prompt rows cost little beside its
# decode rows, where a CPU pays for each (docs/benchmarks.md, "On a GPU").
GPU_PREFILL_ROWS = 1024


def _serve_default(name: str) -> Any:
    """serve.<name>'s default: ServeConfig (infra/config.py) is the one place it is defined."""
    return ServeConfig.model_fields[name].get_default(call_default_factory=True)


@dataclass(frozen=True)
class EngineOptions:
    """The engine's share of the serve section, plus what only the engine's caller sets.

    Every field named like a ServeConfig field takes that field's default and is checked by its
    validators (bounds, k_policy's and cuda_graphs' values, tree's shape), so a default or a
    bound is written once, in infra/config.py. `from_config` copies them from a loaded config.
    """

    k: int = _serve_default("k")
    k_policy: str = _serve_default("k_policy")  # cost, schedule or fixed (module doc)
    draft_gate: bool = _serve_default("draft_gate")  # the cost rule's gate on batched drafting
    capture_top_k: int = _serve_default("capture_top_k")
    max_seq_len: int = _serve_default("max_seq_len")
    # KV cache slots preallocated for concurrent requests, which decode together (one target
    # forward a step for all of them); more requests wait for a slot, at most max_queue of
    # them (more are refused: Overloaded) for at most queue_timeout_s.
    max_concurrency: int = _serve_default("max_concurrency")
    # Prompt tokens a step prefills (serve/engine/scheduler.py): a long prompt advances by one chunk
    # a step between the running requests' decode steps.
    prefill_chunk: int = _serve_default("prefill_chunk")
    # Prompts start from the longest prefix a slot holds (serve/engine/prefix.py).
    prefix_reuse: bool = _serve_default("prefix_reuse")
    max_queue: int = _serve_default("max_queue")
    queue_timeout_s: float = _serve_default("queue_timeout_s")
    # CUDA graphs for Llama forwards of up to k+1 tokens (serve/model/cuda_graphs.py): "auto" = on CUDA.
    cuda_graphs: str = _serve_default("cuda_graphs")
    # "TOTAL,DEPTH,TOPK": steps verify an EAGLE-2 tree (serve/spec_decode/trees/stages.py; sampled requests
    # draw the tree from q and verify it by recursive rejection) instead of a chain; "" = chains.
    tree: str = _serve_default("tree")
    # Not config, the engine's own. Whether requests may be captured at all (a request still
    # opts in or out):
    capture: bool = True
    # The draft stops early where its top probability falls below this (0: never; module doc).
    # An experiment's setting (`osd bench engine --confidence-sweep`), off in serving.
    draft_confidence: float = 0.0
    # How the decoder weights are multiplied (serve/model/linear.py): model.quant as resolved
    # (ModelConfig.resolved): "none" as loaded, "int4" group-wise 4-bit (the GGUF target's own
    # Q4_1 codes), for the target and its drafts.
    quant: str = "none"
    # An int4 target's CPU forward (infra/config.py ModelConfig.cpu_kernels): auto, native, torch.
    cpu_kernels: str = ModelConfig.model_fields["cpu_kernels"].default

    @classmethod
    def from_config(cls, serve: ServeConfig, model: ModelConfig | None = None) -> "EngineOptions":
        own = {name: getattr(serve, name) for name in _SERVE_FIELDS}
        if model is not None:
            own.update(quant=model.resolved().quant, cpu_kernels=model.cpu_kernels)
        return cls(**own)

    def __post_init__(self) -> None:
        try:  # ServeConfig's and ModelConfig's own validators: one definition of each bound
            ServeConfig.model_validate({name: getattr(self, name) for name in _SERVE_FIELDS})
            ModelConfig.model_validate({"cpu_kernels": self.cpu_kernels})
        except ValidationError as e:
            raise EngineError("; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']} (got {err['input']!r})"
                                        for err in e.errors())) from None
        if self.quant not in QUANT_MODES:
            raise EngineError(f"quant must be one of {', '.join(QUANT_MODES)}, got {self.quant!r}")
        if not 0.0 <= self.draft_confidence < 1.0:
            raise EngineError(f"draft_confidence must be in [0, 1), got {self.draft_confidence}")


_SERVE_FIELDS = tuple(f.name for f in fields(EngineOptions) if f.name in ServeConfig.model_fields)


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    text: str | None
    stats: SpecStats
    capture: Capture | None
    prefill_s: float
    decode_s: float
    # Per output token (its logprob, [(id, logprob)] of the most likely), raw target
    # distribution; None unless GenerationParams.logprobs was set.
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    cached_tokens: int = 0  # prompt tokens whose keys and values a slot already held

    @property
    def usage(self) -> dict[str, Any]:
        """OpenAI's usage object, with the prompt tokens its prefix cache served."""
        p, c = len(self.prompt_ids), len(self.output_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


# ---------------------------------------------------------------- engine

class SpecEngine:
    """Holds a target and an optional draft (any causal LMs sharing a vocab).

    `generate()` runs one request to the end; `stream()` is an async generator of token
    lists for serving. Concurrent requests each take their own preallocated KV slot and
    decode together: one target forward a step carries every active request's rows
    (serve/engine/scheduler.py), so requests never wait for each other's steps.
    """

    def __init__(self, target_model: Any, draft_model: Any | None = None, tokenizer: Any = None,
                 options: EngineOptions | None = None):
        self.options = options or EngineOptions()
        self.tokenizer = tokenizer
        self.target = self._runner(target_model, self.options.quant)
        self.draft = self._draft_runner(draft_model) if draft_model is not None else None
        # On a GPU: the pool forward's bucketed shapes and graphs, host copies through a staging ring.
        self.gpu = self.target.device.type == "cuda"
        self.ring = StagingRing(self.target.device) if self.gpu else None
        self.tree = TreeShape.parse(self.options.tree) if self.options.tree else None
        if self.tree is not None:  # every tree block size is captured once, as k+1 is for chains
            if isinstance(self.target, GraphLlamaRunner):
                self.target.max_graph_tokens = max(self.target.max_graph_tokens, self.tree.total)
            if self.draft is not None:
                self.draft.reserve_graph_tokens(self.tree.total)
        if tokenizer is not None and len(tokenizer) > self.target.vocab_size:
            raise EngineError(f"tokenizer has {len(tokenizer)} tokens, more than the model's {self.target.vocab_size}")
        self.max_seq_len = min(self.target.max_seq_len, self.draft.max_seq_len if self.draft else 10**9)
        self.device = self.target.device
        self.eos = frozenset(eos_token_ids(tokenizer, getattr(target_model.config, "eos_token_id", None)))
        slots = []
        # One pool: batched attention. Its positions grow as requests need them, except where
        # forwards address the whole cache (CUDA graphs, draft trees).
        growable = not self.gpu and self.tree is None
        for cache in self.target.new_caches(self.options.max_concurrency, growable):
            slot = Slot(cache)
            if self.draft is not None:
                slot.draft_cache(self.draft)  # preallocate, as before hot swap existed
            slots.append(slot)
        self.slots: SlotPool[Slot] = SlotPool(slots, self.options.max_queue, self.options.queue_timeout_s)
        # Steps run on the threads that wait for them (run_once).
        chunk = self.options.prefill_chunk if not self.gpu else max(self.options.prefill_chunk, GPU_PREFILL_ROWS)
        self.scheduler = Scheduler(self.slots, chunk)
        self._stepping = threading.Lock()  # one round at a time, whoever drives it
        self._drivers: dict[int, asyncio.Task] = {}  # event loop id -> its driver task
        # The draft-length policy (serve.k_policy), made at the first speculative request (the
        # cost rule profiles the target then).
        self._lengths: LengthPolicy | None = None

    def _runner(self, model: Any, quant: str = "none", make: Any = None) -> Runner:
        """The model's runner (`make`'s: make_runner's for the target); on CUDA a Llama gets CUDA graphs for its forwards of up to k+1
        tokens (decode, verify, draft steps) unless cuda_graphs is off."""
        kernels = self.options.cpu_kernels
        if self.options.tree:  # trees verify through masked forwards, which the native kernels lack
            if kernels == "native":
                raise EngineError("serve.tree needs model.cpu_kernels auto or torch: the native forward "
                                  "verifies chains, not trees")
            kernels = "torch"
        try:
            runner = (make or make_runner)(model, self.options.max_seq_len, quant, kernels)
        except ValueError as e:
            raise EngineError(str(e)) from None
        want = self.options.cuda_graphs
        on_cuda = runner.device.type == "cuda"
        if want == "on" and not on_cuda:
            raise EngineError("cuda_graphs=on needs a CUDA model; use auto or off on CPU")
        if want != "off" and on_cuda and type(runner) is LlamaRunner:
            runner = GraphLlamaRunner(model, self.options.max_seq_len)
            runner.max_graph_tokens = self.options.k + 1
        elif want != "off" and on_cuda and hasattr(runner, "enable_graphs"):  # a draft's own graphs
            runner.enable_graphs(self.options.k + 1)
        return runner

    def _draft_runner(self, draft_model: Any) -> Draft:
        # A draft's weights take the target's format: an int4 target's truncate/self drafts
        # share its int4 layers, and a head reads a quarter of the bytes (only acceptance moves).
        runner = as_draft(draft_model, lambda model: self._runner(model, self.options.quant, draft_runner))
        if runner.vocab_size != self.target.vocab_size:
            raise EngineError(
                f"draft vocab ({runner.vocab_size}) differs from the target's ({self.target.vocab_size}); "
                f"speculative decoding needs one shared tokenizer and vocab"
            )
        return runner

    def make_draft(self, draft_model: Any) -> Draft:
        """A runner for `draft_model`, usable as the per-request `draft=` of generate/stream.
        Requests are validated against the engine's context, so a draft with a shorter one is
        refused here rather than failing a request half-way."""
        runner = self._draft_runner(draft_model)
        if runner.max_seq_len < self.max_seq_len:
            raise EngineError(f"draft context ({runner.max_seq_len} tokens) is shorter than the engine's "
                              f"({self.max_seq_len}); requests could outgrow the draft's cache")
        return runner

    # -- validation at the call ------------------------------------------------

    def check_request(self, prompt_ids: Sequence[int], params: GenerationParams) -> list[int]:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise RequestError("prompt is empty")
        if params.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
        bad = [t for t in prompt if not 0 <= t < self.target.vocab_size]
        if bad:
            raise RequestError(f"prompt has token ids outside the vocab [0, {self.target.vocab_size}): {bad[:5]}")
        if len(prompt) + params.max_new_tokens > self.max_seq_len:
            raise RequestError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                f"the context of {self.max_seq_len} tokens", code="context_length_exceeded")
        self._check_processing(params)
        return prompt

    def _check_processing(self, params: GenerationParams) -> None:
        """What the vocab and the budget bound: logit_bias and stop ids, min_tokens, logprobs."""
        vocab = self.target.vocab_size
        for name, ids in (("logit_bias", [t for t, _ in params.processors.logit_bias]),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"{name} has token ids outside the vocab [0, {vocab}): {bad[:5]}")
        if params.processors.min_tokens > params.max_new_tokens:
            raise RequestError(f"min_tokens ({params.processors.min_tokens}) is over max_new_tokens "
                               f"({params.max_new_tokens})")
        if params.logprobs is not None and not 0 <= params.logprobs <= vocab:
            raise RequestError(f"logprobs must be in [0, {vocab}], got {params.logprobs}")

    # -- the loop ---------------------------------------------------------------

    def _start(self, prompt: list[int], params: GenerationParams, slot: Slot, draft: Any = DEFAULT) -> Seq:
        draft = self.draft if draft is DEFAULT else draft
        use_draft = draft is not None and params.speculate and self.options.k > 0
        k = self.options.k if use_draft else 0
        cap = None
        if params.capture and self.options.capture:
            cap = CaptureBuffer(params.max_new_tokens, min(self.options.capture_top_k, self.target.vocab_size),
                                self.device)
        seq = Seq(prompt, params, slot, k, self.eos, cap, self.device, draft if use_draft else None, self.ring)
        if params.processors.active:
            seq.proc = LogitsProcessor(params.processors, prompt, seq.eos, self.target.vocab_size, self.device)
        if params.stop and self.tokenizer is not None:
            seq.stops = StopScanner(self.tokenizer, params.stop)
        if seq.draft is not None:
            seq.length = self.lengths().start(id(seq.draft), params.min_draft)
        # A draft that reads the target's features takes its own cache's rows over the prefix too.
        seq.may_reuse = self.options.prefix_reuse and hasattr(slot.target, "take_prefix") and (
            not seq.reads_features or hasattr(seq.dcache, "take_prefix"))
        begin_prefill(seq)
        if not seq.prefilling:  # a one-token prompt: nothing to prefill
            end_prefill(seq)
        return seq

    def _submit(self, prompt: list[int], params: GenerationParams, slot: Slot, draft: Any, deliver) -> Seq:
        """Hand a request to the scheduler (the caller then drives it: run_once); its
        slot is the scheduler's until it finishes, fails or is cancelled (Seq.cancelled), when
        the scheduler returns it."""
        try:
            seq = self._start(prompt, params, slot, draft)
        except BaseException:
            self.slots.release(slot)
            raise
        seq.deliver = deliver
        seq.t_submit = time.perf_counter()
        if not seq.prefilling:
            seq.t_decode = seq.t_submit
        self.scheduler.submit(seq)
        return seq

    def lengths(self) -> LengthPolicy:
        """The draft-length policy (serve/spec_decode/k_policy.py), the one place a draft's length
        is decided; the cost rule profiles the target's forward by row count on first use (a
        few forwards of 1..k+1 rows, and of batched steps' row counts, over scratch caches:
        about a second)."""
        if self._lengths is None:
            self._lengths = length_policy(self.options.k_policy, self.options.k, self._profile_forward,
                                          self.options.draft_gate)
        return self._lengths

    def gate_state(self) -> dict[str, Any]:
        """The cost rule's gate on batched drafting, per batch size (draft_gate.py); {} without one."""
        gate = getattr(self._lengths, "gate", None)
        return gate.state() if gate is not None else {}

    def _profile_forward(self) -> list[float]:
        """V(rows): up to k+1 rows one sequence's forward (a request alone), and up to the
        draft's longest chain beyond k (sparser, interpolated); beyond, a batched step's
        (one-row sequences in a pool, or k+1-row verify blocks once rows outnumber slots)."""
        k = self.options.k
        alone = max(k, self.draft.max_chain if self.draft is not None else 0)
        slots = min(self.options.max_concurrency, 16)
        context = max(1, min(64, self.max_seq_len - alone - 2))
        span = min(self.max_seq_len, context + alone + 2)
        # growable: only the profile's positions. Not on a GPU: its graphs attend over a cache of
        # max_seq_len positions (forward_static), so a grown-to-fit cache fails their capture.
        caches = self.target.new_caches(slots, growable=not self.gpu)
        gen = torch.Generator().manual_seed(0)

        def tokens(n: int) -> torch.Tensor:
            return torch.randint(0, self.target.vocab_size, (n,), generator=gen).to(self.device)

        for cache in caches:
            forward_batch(self.target, [Item(tokens(context), cache, logits=False)])

        def forward(rows: int) -> float:
            n = 1 if rows <= alone + 1 else min(slots, rows)
            sizes = [rows // n + (i < rows % n) for i in range(n)]
            items = [Item(tokens(t), c) for t, c in zip(sizes, caches)]
            if self.gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            forward_batch(self.target, items, pool=self.gpu)
            if self.gpu:
                torch.cuda.synchronize()
            for c in caches:
                c.truncate(context)
            return time.perf_counter() - t0

        max_rows = min(self.options.max_concurrency * (k + 1), 64) if k else 0
        return profile_forward(forward, min(k, span - context - 1), max_rows=max_rows,
                               alone_rows=min(alone, span - context - 1) + 1)

    @contextlib.contextmanager
    def step_threads(self) -> Iterator[None]:
        """Around a step (run_once): torch at one thread while the target is
        the native forward, which runs on threads of its own. torch's OpenMP workers spin on
        the same cores after each of the step's small torch ops and stall it (several times the
        forward's own time; docs/benchmarks.md); outside steps torch keeps its count,
        for whatever else the process runs (a warm start's training after its generation)."""
        if not isinstance(self.target, NativeLlamaRunner):
            yield
            return
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(n)

    # -- what the step asks of the engine (serve/engine/step.py) ------------------------------

    def begin_step(self) -> None:
        """Before a step's host-to-device copies: the staging ring's slots are free again, since
        every earlier step ended with a read of its results (serve/model/cuda_graphs.py StagingRing)."""
        if self.ring is not None:
            self.ring.reset()

    def _limit(self, seq: Seq) -> int:
        remaining = seq.params.max_new_tokens - len(seq.out)
        return min(remaining - 1, self.max_seq_len - len(seq.tokens) - 1)

    def plan(self, seqs: list[Seq], prefill_rows: int = 0) -> list[int]:
        """Every drafting request's length for one step, from the one policy, asked once for the
        whole step; 0 for a request without a draft."""
        limits = [self._limit(s) for s in seqs]
        if not any(s.length is not None for s in seqs):
            return [0] * len(seqs)
        return self.lengths().plan([s.length for s in seqs], limits, len(seqs) + prefill_rows, prefill_rows)

    def observe_forward(self, sequences: int, rows: int, seconds: float) -> None:
        """A batched step's target forward, for the policy's costs (once it exists)."""
        if self._lengths is not None:
            self._lengths.observe_forward(sequences, rows, seconds)

    def step_context(self, seqs: list[Seq], ks: list[int]) -> StepContext:
        """What a draft may read to size its proposals (serve/spec_decode/protocol.py StepContext): the
        policy's cut, where it has one; a step of one request compares with a request alone."""
        cut = self._lengths.cut if self._lengths is not None else None
        gated = self._lengths is not None and self._lengths.gated
        return StepContext(self.options.draft_confidence, self.options.k, self._limit, cut,
                           len(seqs) + sum(ks), len(seqs), gated)

    def use_tree(self, seq: Seq) -> bool:
        """Trees while the whole tree fits the context and its deepest path fits the token
        budget; chains otherwise (and for a runner without masked blocks)."""
        t = self.tree
        remaining = seq.params.max_new_tokens - len(seq.out)
        # Processors make each tree node's distribution depend on its own path: such requests
        # verify chains (serve/engine/stages.py), which process every row by its prefix.
        return (t is not None and seq.draft is not None and seq.proc is None
                and seq.draft.can_tree(seq)
                and remaining > t.depth and len(seq.tokens) - 1 + t.total <= self.max_seq_len)

    # -- the loop: schedule -> step -> update ------------------------------------------

    def run_once(self) -> bool:
        """One round: the scheduler's plan, the step (serve/engine/step.py), the scheduler told
        what it took. False when there was nothing to run.

        Rounds run one at a time on the threads that wait for them: a blocking caller
        (generate) steps in its own thread until its request is done; streams step on their
        event loop, in a driver task that yields to the loop between rounds. Why not a thread
        of its own: libgomp gives every thread that starts parallel regions its own worker
        team, and spins a team's workers only while the process has no more OpenMP threads
        than cores. A second team (a stepping thread beside the thread that loaded the model)
        makes every parallel op wait on a sleeping worker, so a decode forward on a second
        thread ran far slower (docs/benchmarks.md). Ray Serve constructs a replica and runs
        its async methods on one thread, its user-code event loop, so stepping on the loop
        keeps the process at one team. A round blocks that loop for one forward; the replica
        serves nothing but its engine's requests."""
        with self._stepping:
            plan = self.scheduler.schedule()
            if plan is None:
                return False
            try:
                with self.step_threads():
                    took = run_step(self, plan)
            except Exception as e:  # a failed forward fails the requests it carried, not the engine
                self.scheduler.fail(e)
                return True
            if plan.decode and self._lengths is not None:
                self._lengths.observe_step(took.emitted, took.prompt_rows, took.seconds)
            self.scheduler.update(plan, took)
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

    def _result(self, seq: Seq) -> GenerationResult:
        end = time.perf_counter()
        prefill_s = (seq.t_decode or end) - seq.t_submit
        decode_s = end - seq.t_decode if seq.t_decode else 0.0
        capture = None
        if seq.capture is not None:
            n = len(seq.out)
            capture = seq.capture.finish(seq.out, seq.cap_accepted[:n], seq.cap_draft_tokens[:n],
                                         seq.cap_draft_probs[:n])
        text = seq.text
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(seq.params.shown(seq.out), skip_special_tokens=True)
        return GenerationResult(seq.tokens[: seq.n_prompt], seq.out, seq.finish or "length", text, seq.stats,
                                capture, prefill_s, decode_s, seq.logprobs, seq.cached_tokens)

    def generate(self, prompt_ids: Sequence[int], params: GenerationParams | None = None,
                 draft: Any = DEFAULT) -> GenerationResult:
        """Run one request to completion (blocking; it decodes in the batch with any others).
        `draft`: a make_draft runner, None for autoregressive, or the engine's own draft."""
        params = params or GenerationParams()
        prompt = self.check_request(prompt_ids, params)
        box: queue.SimpleQueue = queue.SimpleQueue()
        seq = self._submit(prompt, params, self.slots.acquire_blocking(), draft, box.put)
        while (item := self._next(box)) is not DONE:
            if isinstance(item, BaseException):
                raise item
        return self._result(seq)

    def _next(self, box: queue.SimpleQueue) -> Any:
        """The next item for a blocking caller, stepping the batch in its thread until one comes
        (another thread may be stepping it: then wait for that)."""
        while True:
            try:
                return box.get_nowait()
            except queue.Empty:
                pass
            if not self.run_once():
                try:
                    return box.get(timeout=0.05)
                except queue.Empty:
                    continue

    def generate_many(self, prompts: Sequence[Sequence[int]], params: GenerationParams | None = None,
                      draft: Any = DEFAULT, on_result=None) -> list[GenerationResult]:
        """Run many requests through the batch, up to max_concurrency at once, in order of the
        prompts; `on_result(i, result)` is called as each finishes (progress, streaming)."""
        params = params or GenerationParams()
        checked = [self.check_request(p, params) for p in prompts]
        box: queue.SimpleQueue = queue.SimpleQueue()
        results: list[GenerationResult | None] = [None] * len(checked)
        seqs: dict[int, Seq] = {}
        nxt = 0
        free = self.options.max_concurrency
        while nxt < len(checked) or seqs:
            while nxt < len(checked) and free > 0:
                i = nxt
                seqs[i] = self._submit(checked[i], params, self.slots.acquire_blocking(), draft,
                                       lambda item, i=i: box.put((i, item)))
                nxt, free = nxt + 1, free - 1
            i, item = self._next(box)
            if isinstance(item, BaseException):
                for s in seqs.values():
                    s.cancelled = True
                raise item
            if item is DONE:
                results[i] = self._result(seqs.pop(i))
                free += 1
                if on_result is not None:
                    on_result(i, results[i])
        return results  # type: ignore[return-value]

    def stream(self, prompt_ids: Sequence[int], params: GenerationParams | None = None,
               draft: Any = DEFAULT) -> "RequestStream":
        """Validate now (so a bad request fails at the call), then stream token lists."""
        params = params or GenerationParams()
        return RequestStream(self, self.check_request(prompt_ids, params), params, draft)

    # -- health ---------------------------------------------------------------

    def stalled_s(self) -> float:
        """Seconds since the least recently progressed running request took a step (0: none running)."""
        stamps = [s.progress for s in self.scheduler.waiting()]
        return time.monotonic() - min(stamps) if stamps else 0.0

    def check_health(self, stall_timeout_s: float) -> None:
        """Raise RuntimeError when a running request made no progress for stall_timeout_s, or
        the slot count does not add up."""
        self.slots.check()
        stalled = self.stalled_s()
        if stalled > stall_timeout_s:
            raise RuntimeError(f"a running request made no progress for {stalled:.0f} s (limit {stall_timeout_s:g} s)")


class RequestStream:
    """`async for tokens in stream:` yields each step's new token ids; `.result` is set at the end."""

    def __init__(self, engine: SpecEngine, prompt: list[int], params: GenerationParams, draft: Any = DEFAULT):
        self.engine, self.prompt, self.params = engine, prompt, params
        self.draft = draft  # fixed at the call: a hot swap never changes a request in flight
        self.result: GenerationResult | None = None
        self._slot: Slot | None = None
        self._seq: Seq | None = None

    @property
    def logprobs(self) -> list[tuple[float, list[tuple[int, float]]]]:
        """Log-probabilities of the tokens yielded so far (GenerationResult.logprobs' form; []
        unless asked): a consumer reads those of a step's tokens after the step is yielded."""
        seq = self._seq
        return seq.logprobs if seq is not None and seq.logprobs is not None else []

    async def admit(self) -> None:
        """Wait for a KV slot (bounded: serve.admission.Overloaded or QueueTimeout). Lets a
        server answer 429/503 before it commits to a streaming response; the slot is then
        owned by iteration, or returned by `abandon()` if iteration never starts."""
        if self._slot is None:
            self._slot = await self.engine.slots.acquire()

    def abandon(self) -> None:
        """Return a slot that `admit()` took for an iteration that never started."""
        slot, self._slot = self._slot, None
        if slot is not None:
            self.engine.slots.release(slot)

    async def __aiter__(self) -> AsyncIterator[list[int]]:
        eng = self.engine
        await self.admit()  # Overloaded / QueueTimeout propagate: no slot was taken
        slot, self._slot = self._slot, None
        loop = asyncio.get_running_loop()
        box: asyncio.Queue = asyncio.Queue()
        seq: Seq | None = None

        def post(item: Any) -> None:  # on the scheduler's thread
            try:
                loop.call_soon_threadsafe(box.put_nowait, item)
            except RuntimeError:  # the event loop is gone: nobody reads this request any more
                if seq is not None:
                    seq.cancelled = True

        seq = self._seq = eng._submit(self.prompt, self.params, slot, self.draft, post)
        ended = False
        eng.ensure_driver()
        try:
            pending: Any = None
            while True:
                item, pending = (pending if pending is not None else await box.get()), None
                if item is DONE:
                    ended = True
                    break
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                # Steps that ended while the consumer was busy go out as one chunk: fewer
                # messages through Serve (and less of the GIL) when the loop lags, none held
                # back when it keeps up.
                merged = list(item)
                while not box.empty():
                    nxt = box.get_nowait()
                    if not isinstance(nxt, list):
                        pending = nxt
                        break
                    merged.extend(nxt)
                yield merged
            self.result = eng._result(seq)
        finally:
            if not ended:
                # Dropped mid-request: the scheduler takes the request out of the batch at its
                # next step and only then returns the slot (never to another request before).
                seq.cancelled = True
