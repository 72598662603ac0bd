"""One request's state inside the engine: its parameters, counters, KV slot and progress.

Nothing here is shared between requests; the scheduler (serve/engine/scheduler.py) owns a `Seq`
from submission until it finishes, fails or is cancelled.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import torch

from serve.engine.capture import CaptureBuffer
from serve.engine.detokenize import StopScanner
from serve.model.cuda_graphs import StagingRing
from serve.spec_decode.k_policy import RequestLength
from serve.sampling.processors import LogitsProcessor, ProcessorParams
from serve.model.runner import KVCache, Runner
from serve.engine.tenancy import Origin
from serve.sampling.verify import SamplingParams


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
    # Penalties, logit bias and min_tokens, applied to the target's and the draft's logits
    # alike (serve/sampling/processors.py); records still capture the raw target distribution.
    processors: ProcessorParams = ProcessorParams()
    ignore_eos: bool = False  # never stop on EOS (min_tokens then holds nothing back)
    stop_token_ids: tuple[int, ...] = ()  # vLLM's: these stop as EOS does, ignore_eos or not
    # None: no log-probabilities; n >= 0: each emitted token's and the n most likely at its
    # position, of the raw target distribution (GenerationResult.logprobs).
    logprobs: int | None = None
    origin: Origin = Origin()
    # Prompt prefixes are taken only from requests of the same tenant and salt (serve/engine/prefix.py).
    cache_salt: str | None = None

    def shown(self, tokens: list[int]) -> list[int]:
        """The tokens whose text is output: all but a last one of stop_token_ids (vLLM leaves a
        stop token's text out; a stop token can only be the last, since it ends the request)."""
        return tokens[:-1] if tokens and tokens[-1] in self.stop_token_ids else tokens


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
    # Steps that drafted, by who proposed (a hybrid draft's "head" or "suffix", else the
    # draft's family): source -> [steps, draft tokens, accepted tokens].
    by_source: dict[str, list[int]] = field(default_factory=dict)

    def count_source(self, source: str, drafted: int, accepted: int) -> None:
        if drafted:
            got = self.by_source.setdefault(source, [0, 0, 0])
            got[0] += 1
            got[1] += drafted
            got[2] += accepted

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
        for src, counts in other.by_source.items():
            self.by_source[src] = _add_counts(self.by_source.get(src, [0, 0, 0]), counts)


def _add_counts(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))]


class Held(NamedTuple):
    """What a slot's caches hold for later requests (serve/engine/prefix.py): the tokens at the
    target cache's first positions, whose they are (the request's reuse_scope), and, for a draft
    that reads the target's features, (a weak reference to) that draft and its cache's rows
    over them: another draft's rows are no use."""
    tokens: Sequence[int] = ()
    scope: tuple = ()
    draft: Any = None
    draft_rows: int = 0


NOTHING_HELD = Held()


class Slot:
    """One request's KV memory: the target's cache and a draft cache per draft shape.

    Drafts of one family (every registry version) share one cache shape, so a hot-swapped
    draft reuses the slot's memory; a request truncates the caches it uses at prefill."""

    MAX_DRAFT_SHAPES = 4

    def __init__(self, target: KVCache):
        self.target = target
        self.drafts: dict[Any, KVCache] = {}
        # What the caches hold from the slot's last request, while no request runs in it.
        self.held = NOTHING_HELD

    def draft_cache(self, runner: Runner) -> KVCache | None:
        if not getattr(runner, "uses_kv_cache", True):  # a draft with no forward of its own
            return None
        key = runner.cache_key
        cache = self.drafts.get(key)
        if cache is None:
            if len(self.drafts) >= self.MAX_DRAFT_SHAPES:
                self.drafts.pop(next(iter(self.drafts)))
            cache = self.drafts[key] = runner.new_cache()
        return cache


class Seq:
    """Mutable state of one request; nothing here is shared between requests."""

    def __init__(self, prompt: list[int], params: GenerationParams, slot: Slot, k: int, eos: frozenset[int],
                 capture: CaptureBuffer | None, device: torch.device, draft: Runner | None = None,
                 ring: StagingRing | None = None):
        self.tokens = list(prompt)
        self.ring = ring  # CUDA path: host ints reach the device without a sync
        self.n_prompt = len(prompt)
        self.params = params
        self.slot = slot
        self.draft = draft  # this request's draft (None: autoregressive)
        self.dcache = slot.draft_cache(draft) if draft is not None else None
        # Its share of the draft-length policy (serve/spec_decode/k_policy.py); None without a draft.
        self.length: RequestLength | None = None
        self.eos = (frozenset() if params.ignore_eos else eos) | frozenset(params.stop_token_ids)
        # Set by the engine when params.processors is active (it knows the vocab).
        self.proc: LogitsProcessor | None = None
        # Per emitted token (logprob, [(id, logprob)...]) when params.logprobs is set.
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] | None = (
            [] if params.logprobs is not None else None)
        self.out: list[int] = []
        self.finish: str | None = None
        self.text: str | None = None  # set when a stop string cut the output
        self.stops: StopScanner | None = None  # set by the engine when stop strings apply
        # k: the most a step drafts (the per-position counts' length; a tree's deeper steps extend them)
        self.stats = SpecStats(accepted_per_pos=[0] * k, drafted_per_pos=[0] * k, reached_per_pos=[0] * k)
        self.capture = capture
        self.cap_accepted: list[bool] = []
        self.cap_draft_tokens: list[int] = []
        self.cap_draft_probs: list[float] = []
        self.device = device
        # The draft's own state for this request, by family (serve/spec_decode/protocol.py draft_state).
        self.draft_state: dict[str, Any] = {}
        # The verify forward's features of the layers the draft reads, until commit.
        self.step_feats: torch.Tensor | None = None
        self.step_source = ""  # who proposed this step's drafts (SpecStats.by_source)
        # Scheduling (serve/engine/scheduler.py): prompt tokens in the target's cache (all but the
        # last are prefilled, in chunks), the chunks' head features until the prefill ends,
        # where each step's tokens go, and a cancellation asked by the request's owner.
        self.prefilled = 0
        self.prefill_feats: list[torch.Tensor] = []
        # Whether the prompt may start from a prefix a slot holds (serve/engine/prefix.py), and
        # the prompt tokens it took so (OpenAI's usage.prompt_tokens_details.cached_tokens).
        self.may_reuse = False
        self.cached_tokens = 0
        # Who may share its prefixes: the tenant and the request's cache salt.
        self.reuse_scope = (params.origin.tenant, params.cache_salt)
        self.deliver: Callable[[Any], None] = lambda item: None
        self.cancelled = False
        self.error: BaseException | None = None
        self.t_submit = 0.0
        self.t_decode = 0.0  # when the prefill ended (perf_counter)
        self.progress = 0.0  # monotonic time of the request's last step (engine health)
        seed = params.sampling.seed
        self.seed: int | None = None
        self.gen = None
        if not params.sampling.greedy:
            self.gen = torch.Generator(device=device)
            # The seed, kept: point-mass drafts draw each position from it (verify_positional).
            self.seed = seed if seed is not None else int(torch.randint(0, 2**62, ()).item())
            self.gen.manual_seed(self.seed)

    @property
    def reads_features(self) -> bool:
        """Whether its draft reads the target's features (its prefill needs every prompt row's,
        or the draft cache's rows over a prefix taken from a slot)."""
        return self.draft is not None and bool(self.draft.feature_layers)

    def draft_rows(self, held: Held) -> int:
        """Of what a slot holds, the draft cache rows this request's draft can take (its own)."""
        return held.draft_rows if held.draft is not None and held.draft() is self.draft else 0

    def holding(self) -> Held:
        """What its slot's caches hold of it: committed positions only (a step writes nothing
        below a request's lengths, even one that fails)."""
        tokens = self.tokens[:self.slot.target.length]
        if not self.reads_features or self.dcache is None:
            return Held(tokens, self.reuse_scope)
        return Held(tokens, self.reuse_scope, weakref.ref(self.draft), self.dcache.length)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.n_prompt - 1

    def pending(self, cache: KVCache) -> torch.Tensor:
        """Committed tokens the cache has not seen yet (1, or 2 after a full acceptance)."""
        return self.to_device(self.tokens[cache.length:])

    def draft_logits(self, logits: torch.Tensor, drafted: list[int] | torch.Tensor | None,
                     columns: torch.Tensor | None = None) -> torch.Tensor:
        """A draft's logits [C] for its next token through the request's processors, seeing the
        tokens drafted so far this step, as the target's are at that position; unchanged when
        the request has none. columns: the target ids of a reduced-vocabulary draft's logits."""
        if self.proc is None or drafted is None:
            return logits
        if not isinstance(drafted, torch.Tensor):
            drafted = torch.tensor(drafted, dtype=torch.long, device=logits.device)
        return self.proc.apply(logits.unsqueeze(0), drafted, columns)[0]

    def target_logits(self, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """The target's logits [k+1, V] the sampling rule reads: through the request's processors
        (row j seeing drafts 0..j-1) when it has any. Capture and log-probabilities read the raw ones."""
        return logits if self.proc is None else self.proc.apply(logits, drafts)

    def to_device(self, values: list[int]) -> torch.Tensor:
        if self.ring is not None:
            return self.ring.to_device(values)
        return torch.tensor(values, dtype=torch.long, device=self.device)


