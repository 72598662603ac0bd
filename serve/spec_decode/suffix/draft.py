"""The `suffix` draft: suffix decoding (serve/spec_decode/suffix/index.py) as a draft the engine serves.

It has no weights and no KV cache. Each request gets an index over its own prompt and
output; the replica keeps shared indexes over recent served outputs, each bounded by
`serve.suffix.max_tokens`: one per tenant, or one for all where there are no tenants or a
tenant shares (the request's Origin.pool). A request's output joins its pool's index when it
finishes, unless it opted out of capture (its text then never leaves the request), tagged
with its Origin so deletion can remove it (`forget`). A proposal is the better of the
request's and its pool's greedy chains.

Sampling stays exact: the chain is chosen without drawing (a point mass on each proposed
token), so verification draws the target's own token at each position, from noise fixed by
the request's seed and the position, and accepts while it equals the proposal
(serve/sampling/verify.py verify_positional): the target's distribution whatever was proposed, a
proposal accepted with probability p(x), and a seeded request's tokens independent of what
the replica's index held. Greedy requests compare argmaxes as for any draft. The probability recorded for a proposed token (the records' draft_probs) is the
index's empirical one, the proposal's confidence.

It serves through the Draft protocol (serve/spec_decode/protocol.py): it sizes its own chains, up to the
engine's k whatever the cost plan gave (their probabilities say what they are worth), cut
where the step's expected tokens per second peak (StepContext.worth); it proposes trees
whole from its index. `HybridDraft` is `head+suffix`: at each step the suffix chain where it
expects at least the head's accepted tokens, else the head.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from infra.config import SuffixConfig
from serve.spec_decode.protocol import Draft, Proposal, StepContext, draft_state, no_proposal, shared_seconds
from serve.spec_decode.k_policy import chain_expected, expected_tokens
from serve.spec_decode.suffix.calibration import Calibration
from serve.spec_decode.suffix.index import SuffixProposer
from serve.spec_decode.trees.dynamic import DraftTree


_DEFAULTS = SuffixConfig()
# The index follows a suffix match of at most MAX_DEPTH tokens; a chain stops at a token whose
# empirical probability is below MIN_PROB. A chain is chosen, not drafted, so its length
# costs only verify rows, which the cost profile prices (k_policy.chain_cut): it may run past
# serve.k up to MAX_CHAIN, at most 15, since a verify of up to 16 rows attends row by row
# exactly as decoding does.
MAX_DEPTH, MIN_PROB, MAX_CHAIN = 32, 0.1, 15
# After m lookups in a row that gave nothing verified (no chain, a chain cut to nothing, or
# none of it accepted), a request looks up again only every 2^m steps, at most every
# MAX_WAIT + 1, and never waits more steps than its step has other requests: in a batch of 16
# first-time prompts the lookups took an eighth of each step and found a token in few of them,
# while alone a lookup costs little beside the forward and a missed match much.
MAX_WAIT = 15



_KEYS = itertools.count()


@dataclass
class SuffixState:
    """A request's suffix state: its key in the proposer's request indexes, how many of its
    tokens that index holds, and its step's chain (empirical figures) until commit."""
    key: int = field(default_factory=lambda: next(_KEYS))
    fed: int | None = None
    pending: list[float] | None = None
    misses: int = 0  # lookups in a row that gave nothing verified
    waited: int = 0  # steps since the last lookup

    def due(self, others: int) -> bool:
        """Whether this step looks up (MAX_WAIT's back-off); counts the step."""
        self.waited += 1
        # misses past MAX_WAIT's bit length already give the longest wait (and keep the shift small)
        if self.waited <= min((1 << min(self.misses, MAX_WAIT.bit_length())) - 1, others, MAX_WAIT):
            return False
        self.waited = 0
        return True


def suffix_state(seq: Any) -> SuffixState:
    return draft_state(seq, SuffixDraft.family, SuffixState)

class SuffixDraft(Draft):
    """Suffix decoding for every request of one engine (its indexes are the replica's)."""

    family = "suffix"
    uses_kv_cache = False
    max_seq_len = 1 << 30  # no context limit of its own
    device = torch.device("cpu")  # its proposals go to each request's device

    def __init__(self, vocab_size: int, *, max_tokens: int = _DEFAULTS.max_tokens,
                 max_depth: int = MAX_DEPTH, min_prob: float = MIN_PROB, factor: float = 1.0,
                 offset: float = 0.0, max_chain: int = MAX_CHAIN):
        # max_tokens is serve.suffix's (infra/config.py SuffixConfig); the others, for
        # experiments, are this draft's own.
        if not 1 <= max_chain <= MAX_CHAIN:  # 17+ verify rows no longer attend as decoding does
            raise ValueError(f"max_chain must be in 1..{MAX_CHAIN}, got {max_chain}")
        self.vocab_size = vocab_size
        self.max_chain = max_chain
        self.min_prob, self.factor, self.offset = min_prob, factor, offset
        self.proposer = SuffixProposer(max_tokens, max_depth=max_depth)
        self.calibration = Calibration()
        self.proposed = 0  # chains proposed / steps asked, for the global index's hit rate
        self.asked = 0

    @classmethod
    def from_config(cls, suffix: Any, vocab_size: int) -> "SuffixDraft":
        return cls(vocab_size, max_tokens=suffix.max_tokens)

    def _follow(self, seq: Any) -> int:
        """The request's index brought up to its committed tokens; its key."""
        st = suffix_state(seq)
        if st.fed is None:
            self.proposer.start(st.key, seq.tokens, seq.params.origin.pool)
        elif st.fed < len(seq.tokens):
            self.proposer.extend(st.key, seq.tokens[st.fed:])
        st.fed = len(seq.tokens)
        return st.key

    def chain(self, seq: Any, k: int, confidence: float) -> tuple[list[int], list[float], list[float]]:
        """(tokens, their calibrated probabilities, their empirical ones) of the better index's
        chain of up to k tokens (serve/spec_decode/suffix/calibration.py: the empirical figures overstate
        acceptance); `confidence` also stops it where a calibrated probability falls below it
        (the index's own floor, on the empirical one, is min_prob)."""
        key = self._follow(seq)
        got = self.proposer.propose(key, max_tokens=k, min_prob=self.min_prob, factor=self.factor,
                                    offset=self.offset)
        tokens, raw = list(got.tokens[:k]), list(got.probs[:k])
        probs = self.calibration.chain(raw)
        if confidence > 0:
            cut = next((i for i, p in enumerate(probs) if i > 0 and p < confidence), len(tokens))
            tokens, probs, raw = tokens[:cut], probs[:cut], raw[:cut]
        self.asked += 1
        self.proposed += bool(tokens)
        return tokens, probs, raw

    def propose(self, seqs: list[Any], ks: list[int], ctx: StepContext) -> list[Proposal]:
        return [self._sized(seq, k, ctx) for seq, k in zip(seqs, ks)]

    def _sized(self, seq: Any, k: int, ctx: StepContext) -> Proposal:
        """A chain of up to max_chain or the engine's k (at least the planned k), cut where it
        stops paying."""
        cap = k if ctx.gated else max(k, min(max(ctx.max_k, self.max_chain), ctx.limit(seq)))
        st = suffix_state(seq)
        if cap < 1 or not st.due(ctx.seqs - 1):  # no room for a draft token, or backing off
            return no_proposal(seq.device, self.family, point_mass=True)
        tokens, probs, raw = self.chain(seq, cap, ctx.confidence)
        n = ctx.worth(k, probs)
        st.pending = raw[:n]  # what verification of it teaches the calibration
        if n == 0:
            st.misses += 1
        return Proposal(torch.tensor(tokens[:n], dtype=torch.long, device=seq.device), None, probs[:n],
                        self.family, point_mass=True)

    def can_tree(self, seq: Any) -> bool:
        return True

    def propose_tree(self, seq: Any, shape: Any, ctx: StepContext) -> DraftTree:
        """The better index's most probable paths, up to the shape's nodes (its depth is the
        match's: factor * match + offset, within the request's budget)."""
        key = self._follow(seq)
        got = self.proposer.propose_tree(key, max_nodes=shape.total - 1, min_prob=self.min_prob,
                                         factor=self.factor, offset=self.offset,
                                         max_depth=max(1, min(shape.total - 1, ctx.limit(seq))))
        self.asked += 1
        self.proposed += bool(got.tokens)
        dev = seq.device
        return DraftTree(torch.tensor([seq.tokens[-1]] + got.tokens, dtype=torch.long, device=dev),
                         torch.tensor([-1] + [p + 1 for p in got.parents], dtype=torch.long, device=dev),
                         torch.tensor([0] + got.depths, dtype=torch.long, device=dev),
                         torch.tensor([0.0] + [math.log(c) for c in got.cum_probs], device=dev))

    def commit(self, seq: Any, base: int, n: int, drafted: int, feats: torch.Tensor | None) -> None:
        """A verified step: if it was this draft's chain, its outcome calibrates the figures."""
        st = suffix_state(seq)
        raw, st.pending = st.pending, None
        if raw and seq.step_source == self.family and drafted == len(raw):
            self.calibration.observe(raw, n)
            st.misses = 0 if n else st.misses + 1

    def release(self, seq: Any) -> None:
        """The request left (finished, failed or cancelled): its output joins the shared index
        when it finished and records were allowed for it."""
        st = seq.draft_state.get(self.family)
        if st is None or st.fed is None:
            seq.draft_state.pop(self.family, None)
            return  # it never proposed
        self._follow(seq)  # the last step's tokens too
        del seq.draft_state[self.family]
        keep = seq.params.capture and seq.finish is not None and seq.error is None
        self.proposer.finish(st.key, add_to_global=keep, tag=seq.params.origin)

    def forget(self, matches: Any) -> int:
        """Remove the shared outputs whose Origin `matches` (record deletion); returns how many."""
        return self.proposer.forget(matches)

    def stats(self) -> dict[str, Any]:
        pools = self.proposer.pools.values()
        return {"global_tokens": sum(i.n_tokens for i in pools), "global_bytes": sum(i.nbytes for i in pools),
                "pools": len(pools),
                "proposal_rate": self.proposed / self.asked if self.asked else 0.0,
                "calibration": self.calibration.table()}


class WithSuffix:
    """A weighted draft model (the head) with the suffix draft beside it: the `head+suffix`
    spec, before the engine makes it a HybridDraft around the head's runner."""

    def __init__(self, model: Any, suffix: SuffixDraft):
        self.model, self.suffix = model, suffix


class HybridDraft(Draft):
    """`head+suffix`: at every step, per request, the suffix chain where it expects at least
    as many accepted tokens as the head at its planned k and running acceptance (else 0.5 a
    position), else the head. The head keeps reading the target's features on every step, so
    it catches up on the rows of suffix steps at its next proposal."""

    family = "head+suffix"

    def __init__(self, head: Draft, suffix: SuffixDraft):
        self.head, self.suffix = head, suffix
        self.feature_layers = head.feature_layers
        self.max_chain = suffix.max_chain
        self.vocab_size = head.vocab_size
        self.max_seq_len = head.max_seq_len
        self.device = head.device

    def new_cache(self) -> Any:
        return self.head.new_cache()

    @property
    def cache_key(self) -> tuple:
        return self.head.cache_key

    def prefilled(self, seq: Any, feats: torch.Tensor | None) -> None:
        self.head.prefilled(seq, feats)

    def prefix_taken(self, seq: Any, n: int) -> None:
        self.head.prefix_taken(seq, n)

    def propose(self, seqs: list[Any], ks: list[int], ctx: StepContext) -> list[Proposal]:
        """Each proposal timed as its own (Proposal.seconds): a suffix chain its lookup, a head
        chain its request's lookup and its share of the head's forwards by tokens, so the
        length policy learns the head's cost per token from the head's steps alone."""
        out: list[Proposal | None] = []
        lookup: list[float] = []
        for seq, k in zip(seqs, ks):
            t0 = time.perf_counter()
            got = self._suffix_first(seq, k, ctx)
            lookup.append(time.perf_counter() - t0)
            out.append(None if got is None else got._replace(seconds=lookup[-1]))
        rest = [i for i, got in enumerate(out) if got is None]
        if rest:  # the head's requests draft together (one head forward a position)
            t0 = time.perf_counter()
            heads = self.head.propose([seqs[i] for i in rest], [ks[i] for i in rest], ctx)
            shares = shared_seconds(time.perf_counter() - t0, [p.tokens.numel() for p in heads])
            for i, got, share in zip(rest, heads, shares):
                out[i] = got._replace(seconds=lookup[i] + share)
        return [got for got in out if got is not None]  # every request has one by now

    def _suffix_first(self, seq: Any, k: int, ctx: StepContext) -> Proposal | None:
        got = self.suffix.propose([seq], [k], ctx)[0]
        if got.tokens.numel() and chain_expected(got.own) >= expected_tokens(_alpha(seq), k) - 1:
            return got
        return None

    def can_tree(self, seq: Any) -> bool:
        return True  # the suffix tree where the head has no features yet

    def propose_tree(self, seq: Any, shape: Any, ctx: StepContext) -> DraftTree:
        tree = self.suffix.propose_tree(seq, shape, ctx)
        worth = float(tree.logp[1:].exp().sum()) if tree.size > 1 else 0.0  # expected accepted tokens
        if self.head.can_tree(seq) and worth < expected_tokens(_alpha(seq), shape.depth) - 1:
            return self.head.propose_tree(seq, shape, ctx)
        return tree

    def commit(self, seq: Any, base: int, n: int, drafted: int, feats: torch.Tensor | None) -> None:
        self.head.commit(seq, base, n, drafted, feats)
        self.suffix.commit(seq, base, n, drafted, feats)  # its calibration, after a suffix step

    def release(self, seq: Any) -> None:
        self.suffix.release(seq)

    def teaches_k(self, source: str) -> bool:
        return source != self.suffix.family  # a suffix step says nothing of the head's acceptance or cost

    def reserve_graph_tokens(self, n: int) -> None:
        self.head.reserve_graph_tokens(n)


def _alpha(seq: Any) -> float:
    return seq.length.alpha if seq.length is not None else 0.5


def suffix_of(draft: Any) -> SuffixDraft | None:
    """The suffix draft in a served draft (`suffix` itself, or a head's `+suffix`), if any."""
    return draft if isinstance(draft, SuffixDraft) else getattr(draft, "suffix", None)


def warm_from_records(suffix: SuffixDraft, records: list, origin_of: Any = None) -> int:
    """Start a new replica's shared indexes from the fleet's recent records, oldest first (so
    their budgets evict the oldest): a restarted or added replica drafts from what was served
    before. Records exist only for requests that allowed capture. origin_of(record): its
    Origin (which pool it joins; None: the shared one). Returns the tokens added."""
    def total() -> int:
        return sum(i.n_tokens for i in suffix.proposer.pools.values())

    before = total()
    for rec in records:
        origin = origin_of(rec) if origin_of is not None else None
        suffix.proposer.remember(rec.prompt_ids.tolist(), rec.output_ids.tolist(),
                                 pool=origin.pool if origin is not None else None, tag=origin)
    return total() - before
