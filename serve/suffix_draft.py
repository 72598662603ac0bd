"""The `suffix` draft: suffix decoding (serve/suffix_tree.py) as a draft the engine serves.

It has no weights and no KV cache. Each request gets an index over its own prompt and
output; the replica keeps one shared index over recent served outputs, bounded by
`serve.suffix.max_tokens`, to which a request's output is added when it finishes, unless
it opted out of capture (its text then never leaves the request). A proposal is the better
of the two indexes' greedy chains.

Sampling stays exact: the chain is chosen without drawing (a point mass on each proposed
token), so verification draws the target's own token at each position, from noise fixed by
the request's seed and the position, and accepts while it equals the proposal
(serve/verify.py verify_positional): the target's distribution whatever was proposed, a
proposal accepted with probability p(x), and a seeded request's tokens independent of what
the replica's index held. Greedy requests compare argmaxes as for any draft. The probability recorded for a proposed token (the records' draft_probs) is the
index's empirical one, the proposal's confidence.

The engine asks a draft like this one for a chain (`SuffixDraft.chain`, sized and weighed in
the engine's `_suffix_step`) and to release a sequence when it leaves (`ProposingDraft`);
`uses_kv_cache` says it needs no cache.
"""

from __future__ import annotations

from typing import Any

from serve.suffix_tree import SuffixProposer


class ProposingDraft:
    """A draft that proposes by itself, with no forward of its own through the engine's runners."""

    uses_kv_cache = False
    max_seq_len = 1 << 30  # no context limit of its own

    def release(self, seq: Any) -> None:
        raise NotImplementedError


def is_proposing(draft: Any) -> bool:
    return isinstance(draft, ProposingDraft)


class SuffixDraft(ProposingDraft):
    """Suffix decoding for every request of one engine (its indexes are the replica's)."""

    family = "suffix"
    point_mass = True  # its chains are chosen, never drawn: verified by verify_positional

    def __init__(self, vocab_size: int, *, max_tokens: int = 200_000,
                 max_depth: int = 32, min_prob: float = 0.1, factor: float = 1.0, offset: float = 0.0):
        self.vocab_size = vocab_size
        self.min_prob, self.factor, self.offset = min_prob, factor, offset
        self.proposer = SuffixProposer(max_tokens, max_depth=max_depth)
        self._fed: dict[int, int] = {}  # id(seq) -> tokens of it the request index holds
        self.proposed = 0  # chains proposed / steps asked, for the global index's hit rate
        self.asked = 0

    @classmethod
    def from_config(cls, suffix: Any, vocab_size: int) -> "SuffixDraft":
        return cls(vocab_size, max_tokens=suffix.max_tokens, max_depth=suffix.max_depth,
                   min_prob=suffix.min_prob, factor=suffix.factor, offset=suffix.offset)

    def _follow(self, seq: Any) -> int:
        """The request's index brought up to its committed tokens; its key."""
        key = id(seq)
        fed = self._fed.get(key)
        if fed is None:
            self.proposer.start(key, seq.tokens)
        elif fed < len(seq.tokens):
            self.proposer.extend(key, seq.tokens[fed:])
        self._fed[key] = len(seq.tokens)
        return key

    def chain(self, seq: Any, k: int, confidence: float) -> tuple[list[int], list[float]]:
        """(tokens, their empirical probabilities) of the better index's chain of up to k
        tokens; `confidence` also stops it where a token's empirical probability falls below
        it (the index's own floor is min_prob)."""
        key = self._follow(seq)
        got = self.proposer.propose(key, max_tokens=k, min_prob=self.min_prob, factor=self.factor,
                                    offset=self.offset)
        tokens, probs = list(got.tokens[:k]), list(got.probs[:k])
        if confidence > 0:
            cut = next((i for i, p in enumerate(probs) if i > 0 and p < confidence), len(tokens))
            tokens, probs = tokens[:cut], probs[:cut]
        self.asked += 1
        self.proposed += bool(tokens)
        return tokens, probs

    def release(self, seq: Any) -> None:
        """The request left (finished, failed or cancelled): its output joins the shared index
        when it finished and records were allowed for it."""
        if id(seq) not in self._fed:
            return  # it never proposed
        self._follow(seq)  # the last step's tokens too
        del self._fed[id(seq)]
        keep = seq.params.capture and seq.finish is not None and seq.error is None
        self.proposer.finish(id(seq), add_to_global=keep)

    def stats(self) -> dict[str, Any]:
        index = self.proposer.global_index
        return {"global_tokens": index.n_tokens, "global_bytes": index.nbytes,
                "proposal_rate": self.proposed / self.asked if self.asked else 0.0}


class WithSuffix:
    """A weighted draft (the head) plus the suffix draft, chosen between at every step
    (`head+suffix`): the engine runs the head's runner with `suffix` attached."""

    def __init__(self, model: Any, suffix: SuffixDraft):
        self.model, self.suffix = model, suffix


def release_draft(seq: Any) -> None:
    """A leaving request's per-request draft state, for drafts that keep any."""
    for part in (seq.draft, getattr(seq.draft, "suffix", None)):
        if isinstance(part, ProposingDraft):
            part.release(seq)


def suffix_of(draft: Any) -> SuffixDraft | None:
    """The suffix draft in a served draft (`suffix` itself, or a head's `+suffix`), if any."""
    return draft if isinstance(draft, SuffixDraft) else getattr(draft, "suffix", None)


def warm_from_records(suffix: SuffixDraft, records: list) -> int:
    """Start a new replica's shared index from the fleet's recent records, oldest first (so
    its own budget evicts the oldest): a restarted or added replica drafts from what was
    served before. Records exist only for requests that allowed capture. Returns the tokens added."""
    before = suffix.proposer.global_index.n_tokens
    for rec in records:
        suffix.proposer.remember(rec.prompt_ids.tolist(), rec.output_ids.tolist())
    return suffix.proposer.global_index.n_tokens - before
