"""The one Draft protocol: everything the engine asks of a draft, whatever its family.

    begin (the slot's caches emptied: serve/engine/stages.py begin_prefill)
    -> prefilled(seq, feats)        the target's prompt is in; a draft reading target features gets them
    -> propose(seqs, ks, ctx)       a chain per request, for a batched step
       propose_tree(seq, shape, ctx) a tree for a tree step (where can_tree)
    -> commit(seq, base, n, drafted, feats)  after verification: keep the draft's state at the committed prefix
    -> release(seq)                 the request left

The families (serve/spec_decode/layer.py, serve/spec_decode/head/draft.py, serve/spec_decode/suffix/draft.py, and the hybrid
`head+suffix`) implement it; the engine, the scheduler and the stages call only these methods
and read only these attributes, so a new family is one new class (tests/test_draft_protocol.py
holds both the shared contract and the no-family-branch rule).

Proposals carry who made them (`source`, for the per-source figures) and how they were made:
drawn from a distribution q (verified by rejection sampling), or chosen without a draw
(`point_mass`, verified positionally: serve/sampling/verify.py verify_positional).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, TypeVar

import torch

T = TypeVar("T")


class Proposal(NamedTuple):
    tokens: torch.Tensor  # [n] long, on the engine's device
    q: torch.Tensor | None  # [n, V]: what each token was drawn from; None under greedy or for a point mass
    own: list[float]  # the draft's probability of each token
    source: str  # who proposed: "layer", "head", "suffix"
    point_mass: bool = False  # chosen, not drawn (module doc)
    # The draft's own seconds for this proposal, where it times its parts (the hybrid: a suffix
    # lookup costs little, a head forward much); None: the engine shares the call's time out
    # by tokens, which would charge a head's forward to a batch's suffix chains.
    seconds: float | None = None


def shared_seconds(seconds: float, sizes: list[int]) -> list[float]:
    """A call's seconds shared among the proposals it made, by their tokens (evenly where none
    has a token): the cost a batched draft call puts on each request."""
    total = sum(sizes)
    return [seconds * n / total if total else seconds / len(sizes) for n in sizes]


def no_proposal(device: torch.device, source: str = "", point_mass: bool = False) -> Proposal:
    return Proposal(torch.empty(0, dtype=torch.long, device=device), None, [], source, point_mass)


def draft_state(seq: Any, family: str, make: Callable[[], T]) -> T:
    """The request's state for a draft family, made on first use: one field of the request
    (Seq.draft_state), typed by the family, so a draft keeps nothing keyed by id(seq) and a
    request's state goes with it."""
    state = seq.draft_state.get(family)
    if state is None:
        state = seq.draft_state[family] = make()
    return state


@dataclass(frozen=True)
class StepContext:
    """What the engine knows of a step that a draft may use to size its proposal: drafts
    that decide their own length (the suffix draft) read it; the others draft the planned k."""

    confidence: float  # stop drafting below this top probability (0: never)
    max_k: int  # the engine's k
    limit: Callable[[Any], int]  # draft tokens a request may still take (its budget, the context)
    # (a chain's per-token probabilities, the step's other rows, its other sequences) ->
    # tokens of the chain worth verifying on the target's measured costs (k_policy.chain_cut);
    # None before the costs are profiled (then the whole chain).
    cut: Callable[[list[float], int, int], int] | None = None
    rows: int = 1  # the planned step's rows: each request's pending row plus its planned drafts
    seqs: int = 1  # the requests in the step
    # The policy held this step back from drafting (serve/spec_decode/draft_gate.py): a draft
    # that sizes its own chains proposes no more than the planned k.
    gated: bool = False

    def worth(self, seq_k: int, probs: list[float]) -> int:
        """Tokens of a chain to keep, for a request whose plan gave `seq_k`."""
        if self.cut is None or not probs:
            return len(probs)
        return self.cut(probs, self.rows - seq_k, self.seqs - 1)


class Draft:
    """The protocol with its defaults (a draft with no state of its own needs none of them)."""

    family = ""
    # Target layers whose features the draft reads: the target's forwards then return them
    # (prefill chunks and every verify), and prefilled/commit receive the committed rows'.
    feature_layers: tuple[int, ...] = ()
    uses_kv_cache = True  # False: no per-slot cache (Slot.draft_cache gives None)
    # Longest chain it may propose beyond the engine's k (a draft that sizes its own chains):
    # the engine's cost profile then covers verifies that long.
    max_chain = 0
    vocab_size: int
    max_seq_len: int
    device: torch.device

    def new_cache(self) -> Any:
        raise NotImplementedError

    @property
    def cache_key(self) -> tuple:
        raise NotImplementedError

    def prefilled(self, seq: Any, feats: torch.Tensor | None) -> None:
        """The target has the prompt (all but its last token); feats: their features, when
        feature_layers asked for them (from where a taken prefix ended: prefix_taken)."""

    def prefix_taken(self, seq: Any, n: int) -> None:
        """A draft that reads features: the request's first n prompt positions came from a slot
        (serve/engine/prefix.py), the target's and this draft's cache rows alike, so the
        prefill's features start at position n."""

    def propose(self, seqs: list[Any], ks: list[int], ctx: StepContext) -> list[Proposal]:
        """A chain for each request, of up to its planned k tokens (a draft that sizes its own
        chains may go up to ctx.max_k within ctx.limit)."""
        raise NotImplementedError

    def can_tree(self, seq: Any) -> bool:
        """Whether this request's next step can verify a tree from this draft."""
        return False

    def propose_tree(self, seq: Any, shape: Any, ctx: StepContext) -> Any:
        """A serve.spec_decode.trees.dynamic.DraftTree rooted at the last committed token (q None: point masses).
        The draft's cache is left at the committed prefix's rows or beyond (commit trims it)."""
        raise NotImplementedError

    def commit(self, seq: Any, base: int, n: int, drafted: int, feats: torch.Tensor | None) -> None:
        """After verification of a step that began with `base` committed tokens and accepted
        n of `drafted`; feats: the target's features of the committed positions, when asked for."""

    def release(self, seq: Any) -> None:
        """The request left (finished, failed or cancelled)."""

    def teaches_k(self, source: str) -> bool:
        """Whether a step proposed by `source` teaches the draft-length rule (acceptance, cost)."""
        return True

    def reserve_graph_tokens(self, n: int) -> None:
        """CUDA graphs, where the draft has them, must cover blocks of n rows (tree steps)."""
