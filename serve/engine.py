"""The speculative decoding engine.

One step is a chain of named stages, each a module-level function that can be timed alone:

    prefill  -> propose -> score -> verify -> commit
    (once)      draft:     target:  pure      accept tokens, roll both KV caches back,
                k tokens   k+1 rows rule      record the target's top-k

Autoregressive decoding is the same loop with no draft (k = 0), so the baseline and the
speculative path share every line that is not speculation.

KV convention: a sequence's cache holds every committed token except the last one, which
is the first input of the next forward. After verify, each cache is truncated to the
committed prefix, so rollback is a length change (see runner.StaticKVCache).

Draft length: at most k tokens per step (config `serve.k`), chosen per step by `k_policy`:
- cost (the serving default, serve/k_policy.py): the length in 0..k with the most expected
  tokens per second, from the target's forward cost by token count (profiled at the first
  speculative step, then measured from every step), the draft's measured cost per token,
  and the request's running acceptance. A draft that cannot pay for its verify drafts
  nothing but a probe token now and then (after 16 idle steps, doubling after each rejected
  probe), so speculation never costs much more than AR.
- schedule: the budget grows by 2 after a step whose drafts were all accepted and shrinks
  by 1 (not below 1) otherwise, the rule of Hugging Face's default assistant schedule.
- fixed: k every step.
And a confidence stop: drafting stops when the draft's top probability at the next position
falls below `draft_confidence` (0 disables it). Decided before drawing, so sampled drafts
still follow q and verification stays exact.
Neither can change the output, only the cost. Never past the token budget or the context.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

import torch

from infra.config import ModelConfig, ServeConfig
from infra.tokens import eos_token_ids
from serve.admission import SlotPool
from serve.capture import Capture, CaptureBuffer
from serve.detokenize import StopScanner
from serve import gpu_stages
from serve.head_runner import commit_head, is_head, prefill_head, propose_head
from serve.errors import EngineError, RequestError  # noqa: F401 (re-exported)
from serve.k_policy import KPolicy, RequestK, StepCosts, profile_forward
from serve.linear import QUANT_MODES
from serve.runner import KVCache, LlamaRunner, Runner, make_runner
from serve.graphs import GraphLlamaRunner, StagingRing
from serve.tree_stages import TreeShape, can_expand, tree_step
from serve.verify import SamplingParams, verify_greedy, verify_sampling, warp_probs


K_POLICIES = ("cost", "schedule", "fixed")
DEFAULT: Any = object()  # "the engine's own draft" for the per-request draft= argument


@dataclass(frozen=True)
class EngineOptions:
    k: int = 4
    draft_confidence: float = 0.0
    k_policy: str = "schedule"  # cost, schedule or fixed (module doc)
    capture: bool = True
    capture_top_k: int = 32
    max_seq_len: int = 2048
    # KV cache slots preallocated for concurrent requests; more requests wait for a slot,
    # at most max_queue of them (more are refused: Overloaded) for at most queue_timeout_s.
    max_concurrency: int = 2
    max_queue: int = 16
    queue_timeout_s: float = 30.0
    # CUDA graphs for Llama forwards of up to k+1 tokens (serve/graphs.py): "auto" = on CUDA.
    cuda_graphs: str = "auto"
    # "TOTAL,DEPTH,TOPK": steps verify an EAGLE-2 tree (serve/tree_stages.py; sampled requests
    # draw the tree from q and verify it by recursive rejection) instead of a chain; "" = chains.
    tree: str = ""
    # How the decoder weights are multiplied (serve/linear.py): "none" as loaded, "int4"
    # group-wise 4-bit (the GGUF target's own Q4_1 codes), for the target and its drafts.
    quant: str = "none"

    @classmethod
    def from_config(cls, serve: "ServeConfig", model: "ModelConfig | None" = None) -> "EngineOptions":
        return cls(k=serve.k, draft_confidence=serve.draft_confidence, k_policy=serve.k_policy,
                   capture_top_k=serve.capture_top_k, max_seq_len=serve.max_seq_len,
                   max_concurrency=serve.max_concurrency, max_queue=serve.max_queue,
                   queue_timeout_s=serve.queue_timeout_s, cuda_graphs=serve.cuda_graphs, tree=serve.tree,
                   quant=model.resolved().quant if model is not None else "none")

    def __post_init__(self) -> None:
        if self.k < 0:
            raise EngineError(f"k must be >= 0, got {self.k}")
        if not 0.0 <= self.draft_confidence < 1.0:
            raise EngineError(f"draft_confidence must be in [0, 1), got {self.draft_confidence}")
        if self.capture_top_k < 1 or self.max_concurrency < 1 or self.max_seq_len < 2:
            raise EngineError("capture_top_k, max_concurrency must be >= 1 and max_seq_len >= 2")
        if self.max_queue < 0 or self.queue_timeout_s <= 0:
            raise EngineError("max_queue must be >= 0 and queue_timeout_s > 0")
        if self.cuda_graphs not in ("auto", "on", "off"):
            raise EngineError(f"cuda_graphs must be auto, on or off, got {self.cuda_graphs!r}")
        if self.k_policy not in K_POLICIES:
            raise EngineError(f"k_policy must be one of {', '.join(K_POLICIES)}, got {self.k_policy!r}")
        if self.quant not in QUANT_MODES:
            raise EngineError(f"quant must be one of {', '.join(QUANT_MODES)}, got {self.quant!r}")
        if self.tree:
            try:
                TreeShape.parse(self.tree)
            except ValueError as e:
                raise EngineError(str(e)) from None


@dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    capture: bool = True
    # Set False to decode autoregressively on an engine that has a draft.
    speculate: bool = True
    # Draft at least this many tokens a step (within k and the budget) whatever the cost rule
    # says: a canary comparison needs served acceptance from both arms, even where drafting
    # does not pay.
    min_draft: int = 0


STAGES = ("propose", "score", "verify", "commit")


@dataclass
class SpecStats:
    """Counters with the meanings of vLLM's spec_decode metrics."""

    num_steps: int = 0  # target forwards after prefill
    num_drafts: int = 0  # steps in which the draft proposed at least one token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # tokens emitted by steps (accepted + one per step)
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)  # steps that proposed a token at i
    # Steps that proposed a token at i after accepting every earlier one: accepted / reached is
    # the acceptance at i given the prefix (what a draft's offline per-depth agreement measures);
    # accepted / drafted also counts steps that had already stopped before i.
    reached_per_pos: list[int] = field(default_factory=list)
    # Wall seconds spent in each stage, summed over steps (prefill excluded).
    stage_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    # The score stage by the target forward's token count T: T -> [steps, seconds] (CPU path;
    # the GPU path's stage times arrive as events, per stage only).
    score_by_tokens: dict[int, list[float]] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Tokens emitted per target forward (1 for AR, up to k+1 for speculation)."""
        return self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0

    def merge(self, other: "SpecStats") -> None:
        self.num_steps += other.num_steps
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_emitted_tokens += other.num_emitted_tokens
        self.accepted_per_pos = _add_counts(self.accepted_per_pos, other.accepted_per_pos)
        self.drafted_per_pos = _add_counts(self.drafted_per_pos, other.drafted_per_pos)
        self.reached_per_pos = _add_counts(self.reached_per_pos, other.reached_per_pos)
        for name in STAGES:
            self.stage_s[name] += other.stage_s[name]
        for t, (n, sec) in other.score_by_tokens.items():
            mine = self.score_by_tokens.setdefault(t, [0, 0.0])
            mine[0] += n
            mine[1] += sec


def _add_counts(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))]


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

    @property
    def usage(self) -> dict[str, int]:
        p, c = len(self.prompt_ids), len(self.output_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


# ---------------------------------------------------------------- per-request state

class _Slot:
    """One request's KV memory: the target's cache and a draft cache per draft shape.

    Drafts of one family (every registry version) share one cache shape, so a hot-swapped
    draft reuses the slot's memory; a request truncates the caches it uses at prefill."""

    MAX_DRAFT_SHAPES = 4

    def __init__(self, target: KVCache):
        self.target = target
        self.drafts: dict[Any, KVCache] = {}

    def draft_cache(self, runner: Runner) -> KVCache:
        key = runner.cache_key
        cache = self.drafts.get(key)
        if cache is None:
            if len(self.drafts) >= self.MAX_DRAFT_SHAPES:
                self.drafts.pop(next(iter(self.drafts)))
            cache = self.drafts[key] = runner.new_cache()
        return cache


class _Seq:
    """Mutable state of one request; nothing here is shared between requests."""

    def __init__(self, prompt: list[int], params: GenerationParams, slot: _Slot, k: int, eos: frozenset[int],
                 capture: CaptureBuffer | None, device: torch.device, draft: Runner | None = None,
                 ring: StagingRing | None = None):
        self.tokens = list(prompt)
        self.ring = ring  # CUDA path: host ints reach the device without a sync
        self.stamps: list[list[Any]] = []  # CUDA path: each step's stage events, read at the end
        self.n_prompt = len(prompt)
        self.params = params
        self.slot = slot
        self.draft = draft  # this request's draft (None: autoregressive)
        self.dcache = slot.draft_cache(draft) if draft is not None else None
        self.k = k  # this request's current draft budget (k_policy schedule moves it within [1, k])
        self.kreq: RequestK | None = None  # k_policy cost: this request's choice of k
        self.eos = eos
        self.out: list[int] = []
        self.finish: str | None = None
        self.text: str | None = None  # set when a stop string cut the output
        self.stops: StopScanner | None = None  # set by the engine when stop strings apply
        self.stats = SpecStats(accepted_per_pos=[0] * k, drafted_per_pos=[0] * k, reached_per_pos=[0] * k)
        self.capture = capture
        self.cap_accepted: list[bool] = []
        self.cap_draft_tokens: list[int] = []
        self.cap_draft_probs: list[float] = []
        self.device = device
        # Head drafts only (serve/head_runner.py): target features of rows the head has not
        # cached yet, from row feat_start on; and the verify forward's, until commit.
        self.feats: torch.Tensor | None = None
        self.feat_start = 0
        self.step_feats: torch.Tensor | None = None
        seed = params.sampling.seed
        self.gen = None
        if not params.sampling.greedy:
            self.gen = torch.Generator(device=device)
            self.gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))

    def pending(self, cache: KVCache) -> torch.Tensor:
        """Committed tokens the cache has not seen yet (1, or 2 after a full acceptance)."""
        return self.to_device(self.tokens[cache.length:])

    def to_device(self, values: list[int]) -> torch.Tensor:
        if self.ring is not None:
            return self.ring.to_device(values)
        return torch.tensor(values, dtype=torch.long, device=self.device)


# ---------------------------------------------------------------- stages

def prefill(target: Runner, draft: Runner | None, seq: _Seq) -> None:
    """Run the prompt, all but its last token, through both models."""
    slot = seq.slot
    slot.target.truncate(0)
    head = torch.tensor(seq.tokens[:-1], dtype=torch.long, device=seq.device)
    if is_head(draft):
        # The head reads the prefill's features: all but the last of its rows run now, the
        # last at the first propose (which then drafts from one row, as every later step).
        layers = draft.feature_layers
        seq.feats = target.prefill(head, slot.target, layers) if head.numel() else None
        seq.feat_start = 0
        seq.dcache.truncate(0)
        prefill_head(draft, seq)
        return
    if head.numel():
        target.prefill(head, slot.target)
    if draft is not None and seq.dcache is not None:
        seq.dcache.truncate(0)
        if head.numel():
            draft.prefill(head, seq.dcache)


def propose(draft: Runner, seq: _Seq, k: int, confidence: float):
    """Draft up to k tokens. Returns (tokens [n] long, q [n, V] probs or None, own-probs list)."""
    params = seq.params.sampling
    cache = seq.dcache
    inp = seq.pending(cache)
    tokens: list[int] = []
    qs: list[torch.Tensor] = []
    own: list[float] = []
    if inp.numel() > 1:
        # Tokens committed while the draft sat out (the cost rule's k = 0, a full acceptance):
        # into its cache without an output projection over every one of them.
        draft.prefill(inp[:-1], cache)
        inp = inp[-1:]
    for i in range(k):
        logits = draft.forward(inp, cache)[-1]
        probs = torch.softmax(logits, dim=-1) if params.greedy else warp_probs(logits, params)
        # The first proposal is always made; later ones only while the draft is confident.
        # Decided on the draft's top probability *before* drawing: stopping on the drawn token's
        # own probability biases kept drafts away from q and made sampling lossy (greedy: same).
        if i > 0 and float(probs.max()) < confidence:
            break  # the cache keeps the proposals fed so far; commit trims what is rejected
        if params.greedy:
            tok = int(torch.argmax(probs))
        else:
            tok = int(torch.multinomial(probs, 1, generator=seq.gen))
        p_tok = float(probs[tok])
        tokens.append(tok)
        own.append(p_tok)
        if not params.greedy:
            qs.append(probs)
        inp = torch.tensor([tok], dtype=torch.long, device=seq.device)
    drafts = torch.tensor(tokens, dtype=torch.long, device=seq.device)
    q = torch.stack(qs) if qs else None
    return drafts, q, own


def score(target: Runner, seq: _Seq, drafts: torch.Tensor) -> torch.Tensor:
    """One target forward over [last committed token, drafts...] -> logits [len(drafts)+1, V]."""
    inp = torch.cat([seq.pending(seq.slot.target), drafts])
    if is_head(seq.draft):
        logits, seq.step_feats = target.forward_features(inp, seq.slot.target, seq.draft.feature_layers)
        return logits
    return target.forward(inp, seq.slot.target)


def verify(seq: _Seq, drafts: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor) -> tuple[int, int]:
    params = seq.params.sampling
    if params.greedy:
        return verify_greedy(drafts, torch.argmax(logits, dim=-1))
    return verify_sampling(drafts, q if q is not None else logits.new_zeros(0, logits.shape[-1]),
                           warp_probs(logits, params), seq.gen)


def commit(seq: _Seq, drafts: list[int], own: list[float], logits: torch.Tensor, n: int,
           nxt: int) -> list[int]:
    """Accept n drafts (host ints) plus `nxt`, roll both caches back to the committed prefix,
    record capture rows, apply stop rules. Returns the tokens this step emitted."""
    k = len(drafts)
    base = len(seq.tokens)
    new = drafts[:n] + [nxt]
    # score() fed the target [last committed, drafts...] on top of base - 1 cached tokens. Keep
    # all committed tokens plus the n accepted drafts; `nxt` is the next forward's first input.
    seq.slot.target.truncate(base + n)
    if is_head(seq.draft):
        commit_head(seq, base, seq.step_feats[: n + 1])
        seq.step_feats = None
    elif seq.dcache is not None and k:
        seq.dcache.truncate(min(seq.dcache.length, base + n))
    st = seq.stats
    st.num_steps += 1
    st.num_emitted_tokens += n + 1
    if k:
        st.num_drafts += 1
        st.num_draft_tokens += k
        st.num_accepted_tokens += n
        for per_pos in (st.accepted_per_pos, st.drafted_per_pos, st.reached_per_pos):  # a tree can go deeper than k
            per_pos.extend([0] * (k - len(per_pos)))
        for i in range(k):
            st.accepted_per_pos[i] += i < n
            st.drafted_per_pos[i] += 1
            st.reached_per_pos[i] += i <= n
    if seq.capture is not None:
        seq.capture.add(logits[: n + 1])
        seq.cap_accepted += [True] * n + [False]
        seq.cap_draft_tokens += new[:n] + ([drafts[n]] if n < k else [-1])
        seq.cap_draft_probs += own[:n] + ([own[n]] if n < k else [float("nan")])
    emitted = []
    for tok in new:
        seq.tokens.append(tok)
        seq.out.append(tok)
        emitted.append(tok)
        if tok in seq.eos:
            seq.finish = "stop"
            break
        if len(seq.out) >= seq.params.max_new_tokens:
            seq.finish = "length"
            break
    if seq.stops is not None:
        _apply_stop_strings(seq, seq.stops, emitted)
    return emitted


def _event() -> Any:
    """A stage boundary: a recorded CUDA event, or the clock where there is no GPU (tests run
    the device-path stages on CPU)."""
    if not torch.cuda.is_available():
        return time.perf_counter()
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def _settle_stamps(seq: _Seq) -> None:
    """Add the CUDA path's stage times (events recorded per step) to the stats."""
    if not seq.stamps:
        return
    last = seq.stamps[-1][-1]
    if not isinstance(last, float):
        last.synchronize()
    clock = seq.stats.stage_s
    for stamps in seq.stamps:
        for name, a, b in zip(STAGES, stamps, stamps[1:]):
            clock[name] += b - a if isinstance(a, float) else a.elapsed_time(b) / 1e3
    seq.stamps.clear()


def _apply_stop_strings(seq: _Seq, stops: StopScanner, emitted: list[int]) -> None:
    stops.push(emitted)
    if stops.stop_at is not None:
        seq.finish = "stop"
        seq.text = stops.text_before_stop()


# ---------------------------------------------------------------- engine

class SpecEngine:
    """Holds a target and an optional draft (any causal LMs sharing a vocab).

    `generate()` runs one request to the end; `stream()` is an async generator of token
    lists for serving. Concurrent requests each take their own preallocated KV slot, and
    their steps interleave under one lock (one forward at a time per engine).
    """

    def __init__(self, target_model: Any, draft_model: Any | None = None, tokenizer: Any = None,
                 options: EngineOptions | None = None):
        self.options = options or EngineOptions()
        self.tokenizer = tokenizer
        self.target = self._runner(target_model, self.options.quant)
        self.draft = self._draft_runner(draft_model) if draft_model is not None else None
        # The CUDA path (serve/gpu_stages.py): device-resident stages, one host read per step.
        self.gpu = self.target.device.type == "cuda"
        self.ring = StagingRing(self.target.device) if self.gpu else None
        self.tree = TreeShape.parse(self.options.tree) if self.options.tree else None
        if self.tree is not None:  # every tree block size is captured once, as k+1 is for chains
            for runner in (self.target, self.draft):
                if isinstance(runner, GraphLlamaRunner) or (is_head(runner) and runner.graphs is not None):
                    runner.max_graph_tokens = max(runner.max_graph_tokens, self.tree.total)
        if tokenizer is not None and len(tokenizer) > self.target.vocab_size:
            raise EngineError(f"tokenizer has {len(tokenizer)} tokens, more than the model's {self.target.vocab_size}")
        self.max_seq_len = min(self.target.max_seq_len, self.draft.max_seq_len if self.draft else 10**9)
        self.device = self.target.device
        self.eos = frozenset(eos_token_ids(tokenizer, getattr(target_model.config, "eos_token_id", None)))
        slots = []
        for _ in range(self.options.max_concurrency):
            slot = _Slot(self.target.new_cache())
            if self.draft is not None:
                slot.draft_cache(self.draft)  # preallocate, as before hot swap existed
            slots.append(slot)
        self.slots: SlotPool[_Slot] = SlotPool(slots, self.options.max_queue, self.options.queue_timeout_s)
        self._lock = threading.Lock()
        # Streams step on one thread of their own: forwards are serialized by the lock anyway,
        # and a private thread means a busy engine never takes threads other work needs.
        self._stepper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="osd-engine")
        self._ids = itertools.count()
        self._progress: dict[int, float] = {}  # request -> monotonic time of its last step
        self._kpolicy: KPolicy | None = None  # k_policy cost: made at the first speculative request

    def _runner(self, model: Any, quant: str = "none") -> Runner:
        """The model's runner; on CUDA a Llama gets CUDA graphs for its forwards of up to k+1
        tokens (decode, verify, draft steps) unless cuda_graphs is off."""
        try:
            runner = make_runner(model, self.options.max_seq_len, quant)
        except ValueError as e:
            raise EngineError(str(e)) from None
        want = self.options.cuda_graphs
        on_cuda = runner.device.type == "cuda"
        if want == "on" and not on_cuda:
            raise EngineError("cuda_graphs=on needs a CUDA model; use auto or off on CPU")
        if want != "off" and on_cuda and type(runner) is LlamaRunner:
            runner = GraphLlamaRunner(model, self.options.max_seq_len)
            runner.max_graph_tokens = self.options.k + 1
        elif want != "off" and on_cuda and is_head(runner):
            runner.enable_graphs(self.options.k + 1)
        return runner

    def _draft_runner(self, draft_model: Any) -> Runner:
        # A draft's weights take the target's format: an int4 target's truncate/self drafts
        # share its int4 layers, and a head reads a quarter of the bytes (only acceptance moves).
        runner = self._runner(draft_model, self.options.quant)
        if runner.vocab_size != self.target.vocab_size:
            raise EngineError(
                f"draft vocab ({runner.vocab_size}) differs from the target's ({self.target.vocab_size}); "
                f"speculative decoding needs one shared tokenizer and vocab"
            )
        return runner

    def make_draft(self, draft_model: Any) -> Runner:
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
        return prompt

    # -- the loop ---------------------------------------------------------------

    def _start(self, prompt: list[int], params: GenerationParams, slot: _Slot, draft: Any = DEFAULT) -> _Seq:
        draft = self.draft if draft is DEFAULT else draft
        use_draft = draft is not None and params.speculate and self.options.k > 0
        k = self.options.k if use_draft else 0
        cap = None
        if params.capture and self.options.capture:
            cap = CaptureBuffer(params.max_new_tokens, min(self.options.capture_top_k, self.target.vocab_size),
                                self.device)
        seq = _Seq(prompt, params, slot, k, self.eos, cap, self.device, draft if use_draft else None, self.ring)
        if params.stop and self.tokenizer is not None:
            seq.stops = StopScanner(self.tokenizer, params.stop)
        if seq.draft is not None and self.options.k_policy == "cost":
            seq.kreq = self.k_policy().new_request(id(seq.draft))
        prefill(self.target, seq.draft, seq)
        return seq

    def k_policy(self) -> KPolicy:
        """The cost rule's state, profiling the target's forward by token count on first use
        (a few forwards of 1..k+1 tokens over a scratch cache: well under a second)."""
        if self._kpolicy is None:
            self._kpolicy = KPolicy(StepCosts(self._profile_forward()), self.options.k)
        return self._kpolicy

    def _profile_forward(self) -> list[float]:
        cache = self.target.new_cache()
        context = min(64, self.max_seq_len - self.options.k - 2)
        gen = torch.Generator().manual_seed(0)
        self.target.forward(torch.randint(0, self.target.vocab_size, (max(context, 1),), generator=gen
                                          ).to(self.device), cache)
        base = cache.length

        def forward(t: int) -> float:
            toks = torch.randint(0, self.target.vocab_size, (t,), generator=gen).to(self.device)
            if self.gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.target.forward(toks, cache)
            if self.gpu:
                torch.cuda.synchronize()
            cache.truncate(base)
            return time.perf_counter() - t0

        return profile_forward(forward, min(self.options.k, self.max_seq_len - base - 1))

    def _step(self, seq: _Seq) -> list[int]:
        remaining = seq.params.max_new_tokens - len(seq.out)
        limit = min(remaining - 1, self.max_seq_len - len(seq.tokens) - 1)
        if self._use_tree(seq, remaining):
            return self._stages_tree(seq)
        k = seq.kreq.choose(limit) if seq.kreq is not None else min(seq.k, limit)
        if seq.kreq is not None and seq.params.min_draft:
            k = max(k, min(seq.params.min_draft, limit, self.options.k))
        run = self._stages_gpu if self.gpu else self._stages_cpu
        n, k_drafted, emitted = run(seq, k)
        if seq.kreq is not None:
            seq.kreq.observe(k_drafted, n)
        elif self.options.k_policy == "schedule" and k_drafted:
            budget = self.options.k
            seq.k = min(seq.k + 2, budget) if n == k_drafted else max(seq.k - 1, 1)
        return emitted

    def _use_tree(self, seq: _Seq, remaining: int) -> bool:
        """Trees while the whole tree fits the context and its deepest path fits the token
        budget; chains otherwise (and for a runner without masked blocks)."""
        t = self.tree
        return (t is not None and seq.draft is not None
                and (hasattr(seq.draft, "forward_masked") or is_head(seq.draft)) and can_expand(seq)
                and remaining > t.depth and len(seq.tokens) - 1 + t.total <= self.max_seq_len)

    def _stages_tree(self, seq: _Seq) -> list[int]:
        if self.ring is not None:
            self.ring.reset()
        stamps = [_event()]
        drafts, rows, n, nxt = tree_step(self.target, seq, self.tree, lambda: stamps.append(_event()))
        own = [float("nan")] * len(drafts)  # a tree has no single proposal probability per position
        emitted = commit(seq, drafts, own, rows, n, nxt)
        stamps.append(_event())
        seq.stamps.append(stamps)
        return emitted

    def _stages_cpu(self, seq: _Seq, k: int) -> tuple[int, int, list[int]]:
        clock = seq.stats.stage_s
        t0 = time.perf_counter()
        if k > 0:
            stage = propose_head if is_head(seq.draft) else propose
            drafts, q, own = stage(seq.draft, seq, k, self.options.draft_confidence)
        else:
            drafts, q, own = torch.empty(0, dtype=torch.long, device=self.device), None, []
        t1 = time.perf_counter()
        logits = score(self.target, seq, drafts)
        t2 = time.perf_counter()
        n, nxt = verify(seq, drafts, q, logits)
        t3 = time.perf_counter()
        emitted = commit(seq, drafts.tolist(), own, logits, n, nxt)
        t4 = time.perf_counter()
        for name, a, b in zip(STAGES, (t0, t1, t2, t3), (t1, t2, t3, t4)):
            clock[name] += b - a
        by_t = seq.stats.score_by_tokens.setdefault(logits.shape[0], [0, 0.0])
        by_t[0] += 1
        by_t[1] += t2 - t1
        if seq.kreq is not None:  # the cost rule learns from every step it did not profile
            costs = seq.kreq.policy.costs
            costs.observe_verify(logits.shape[0], t2 - t1)
            if not seq.kreq.probing:  # a probe also catches the draft up on the idle stretch
                costs.observe_draft(seq.kreq.draft_key, drafts.numel(), t1 - t0)
            costs.observe_step(t4 - t2)
        return n, drafts.numel(), emitted

    def _stages_gpu(self, seq: _Seq, k: int) -> tuple[int, int, list[int]]:
        """The same stages on the device: no host sync but the one read in verify. Stage
        times come from CUDA events (read when the request ends), so work queued by one
        stage and run later is still charged to it."""
        if self.ring is not None:
            self.ring.reset()  # the previous step's read has landed every earlier copy
        stamps = [_event()]
        if k > 0:
            stage = gpu_stages.propose_head if is_head(seq.draft) else gpu_stages.propose_layers
            drafts, q, own = stage(seq.draft, seq, k)
        else:
            drafts, q, own = torch.empty(0, dtype=torch.long, device=self.device), None, None
        stamps.append(_event())
        logits = score(self.target, seq, drafts)
        stamps.append(_event())
        n, nxt, draft_ids = gpu_stages.verify(seq, drafts, q, logits)
        stamps.append(_event())
        own_h = own.tolist() if own is not None and seq.capture is not None else [float("nan")] * len(draft_ids)
        emitted = commit(seq, draft_ids, own_h, logits, n, nxt)
        stamps.append(_event())
        seq.stamps.append(stamps)
        return n, len(draft_ids), emitted

    def _result(self, seq: _Seq, prefill_s: float, decode_s: float) -> GenerationResult:
        _settle_stamps(seq)
        capture = None
        if seq.capture is not None:
            n = len(seq.out)
            capture = seq.capture.finish(seq.out, seq.cap_accepted[:n], seq.cap_draft_tokens[:n],
                                         seq.cap_draft_probs[:n])
        text = seq.text
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(seq.out, skip_special_tokens=True)
        return GenerationResult(seq.tokens[: seq.n_prompt], seq.out, seq.finish or "length", text, seq.stats,
                                capture, prefill_s, decode_s)

    def generate(self, prompt_ids: Sequence[int], params: GenerationParams | None = None,
                 draft: Any = DEFAULT) -> GenerationResult:
        """Run one request to completion (blocking). `draft`: a make_draft runner, None for
        autoregressive, or the engine's own draft by default."""
        params = params or GenerationParams()
        prompt = self.check_request(prompt_ids, params)
        slot = self.slots.acquire_blocking()
        try:
            with self._lock:
                t0 = time.perf_counter()
                seq = self._start(prompt, params, slot, draft)
                t1 = time.perf_counter()
                while seq.finish is None:
                    self._step(seq)
                t2 = time.perf_counter()
            return self._result(seq, t1 - t0, t2 - t1)
        finally:
            self.slots.release(slot)

    def stream(self, prompt_ids: Sequence[int], params: GenerationParams | None = None,
               draft: Any = DEFAULT) -> "RequestStream":
        """Validate now (so a bad request fails at the call), then stream token lists."""
        params = params or GenerationParams()
        return RequestStream(self, self.check_request(prompt_ids, params), params, draft)

    def _locked(self, fn, *args):
        with self._lock:
            return fn(*args)

    def _submit(self, fn, *args) -> Future:
        return self._stepper.submit(self._locked, fn, *args)

    # -- health ---------------------------------------------------------------

    def stalled_s(self) -> float:
        """Seconds since the least recently progressed running request took a step (0: none running)."""
        stamps = list(self._progress.values())
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
        self._slot: _Slot | None = None

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
        rid = next(eng._ids)
        eng._progress[rid] = time.monotonic()
        inflight: Future | None = None
        try:
            t0 = time.perf_counter()
            # Forwards run on the engine's thread so the event loop keeps serving other requests.
            inflight = eng._submit(eng._start, self.prompt, self.params, slot, self.draft)
            seq = await asyncio.wrap_future(inflight)
            t1 = time.perf_counter()
            while seq.finish is None:
                eng._progress[rid] = time.monotonic()
                inflight = eng._submit(eng._step, seq)
                emitted = await asyncio.wrap_future(inflight)
                yield emitted
            self.result = eng._result(seq, t1 - t0, time.perf_counter() - t1)
        finally:
            eng._progress.pop(rid, None)
            if inflight is not None and not inflight.done():
                # Cancelled mid-step: the step still writes this slot's caches, so the slot
                # goes back only when it has finished (never to another request before).
                inflight.add_done_callback(lambda _: eng.slots.release(slot))
            else:
                eng.slots.release(slot)
