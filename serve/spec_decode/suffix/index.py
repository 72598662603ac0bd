"""Suffix decoding: drafts read off what was already written (SuffixDecoding, NeurIPS 2025).

A pure data structure (stdlib and numpy only). `SuffixIndex` holds many token sequences and
answers: what is the longest suffix of this context (at most `max_depth` tokens) that occurred
before with a continuation, and which tokens followed it how often. `propose` walks the most
frequent continuations into a chain, `propose_tree` into a best-first tree, each token carrying
its empirical probability. `SuffixProposer` pairs one index per request (prompt + output so
far) with one global index over recent served outputs and keeps the better-scoring proposal.

Representation: positions over a token arena, not a trie.
- Every indexed token is a slot in flat int32 arrays `tok`, `prev`, `next` (the previous and
  next slot of the same sequence, -1 for none). One extra slot at the end is a sentinel
  (-1 in all three), so `prev[-1]` and `tok[-1]` are safe to gather and never match a token.
- A sorted index (int64 key = last token, previous token, the one before, 21 bits each;
  with the slot) finds the slots ending in the context's last three tokens by binary search.
  Slots appended since the last sort (the tail) are scanned; the index is re-sorted once the
  tail exceeds max(256, live / 8), so sorting costs O(log n) per appended token amortized.
- Matching checks the candidates backwards through `prev` with numpy: a filter per step while
  there are many, one 2-D gather once few remain. A chain step maps the set of occurrence
  ends through `next` and keeps those that continue with the chosen token.
Why: a depth-32 trie of dicts takes kilobytes and tens of microseconds per appended token
even without counts (docs/benchmarks.md, "Figures behind code choices"), while this costs
24 bytes per slot (tok, prev, next: 12; sorted key and slot: 12), at most 1.5 slots per live
token, with no per-token Python objects. Appends are slice writes; a whole sequence is
evicted by marking its slots dead, and dead slots are compacted away when the arena fills.
Its append, chain and memory costs are in docs/benchmarks.md ("Figures behind code choices").

Semantics, fixed here because the tests compare with a brute-force reference:
- An occurrence counts only if another token follows it in its sequence.
- A chain or tree path follows the occurrences of the matched suffix extended by the tokens
  proposed so far (walking down a suffix tree; `max_depth` bounds the match, not the walk).
  A path stops where its pattern has no continuation left.
- Conditional probability = count of the token after the pattern / count of the pattern's
  continued occurrences; cumulative = product along the path; score = sum of cumulatives
  (the expected number of accepted tokens if the empirical frequencies were the truth).
- Ties in the chain go to the smallest token id; in the tree, children are ranked by
  (count desc, token asc) and equal cumulative probabilities are taken in push order.
- Budgets: the total live tokens never exceed `max_tokens`; whole sequences are evicted oldest
  first (by first insertion), never the one being appended to. A sequence that alone would
  exceed the budget keeps its newest tokens (for a long request the recent text matters).
"""

from __future__ import annotations

import heapq
import itertools
import math
import sys
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Any
from dataclasses import dataclass, field

import numpy as np

_BITS = 21
MAX_TOKEN_ID = (1 << _BITS) - 2  # token + 1 must fit 21 bits in the sorted key
_SLOT_BYTES = 24  # tok, prev, next (int32) + sorted key (int64) + sorted slot (int32)
# Python objects around the arrays: the index object, its dicts, five ndarray headers.
_FIXED_BYTES = 2048
# Per sequence: dict slot (amortized over the table's growth) + the [first, last, n] record
# and its int objects; the key's own size is added on top. Calibrated with tracemalloc.
_SEQ_BYTES = 240
_SMALL = 32  # below this many candidates, match the rest of the context in one 2-D gather
_MIN_TAIL = 256  # unsorted slots tolerated before re-sorting (a scan of so few is cheap)
_EMPTY = np.empty(0, np.int32)


@dataclass
class Proposal:
    """A draft chain: tokens[i] with its conditional empirical frequency probs[i]."""

    tokens: list[int]
    probs: list[float]
    match_len: int
    score: float  # sum of cumulative path probabilities = expected accepted tokens
    source: str = ""  # "request" or "global" when chosen by SuffixProposer, else ""


@dataclass
class TreeProposal:
    """A draft tree in topological order: parents[i] < i, -1 for children of the root."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)  # 1 for children of the root
    probs: list[float] = field(default_factory=list)  # conditional on the parent's path
    cum_probs: list[float] = field(default_factory=list)  # product along the path
    match_len: int = 0
    score: float = 0.0  # sum of cum_probs
    source: str = ""


def _check_int(name: str, value: object, lowest: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lowest:
        raise ValueError(f"{name} must be an integer >= {lowest}, got {value!r}")
    return int(value)


def _check_walk_args(min_prob: float, factor: float, offset: float) -> None:
    if not (isinstance(min_prob, (int, float)) and 0.0 <= min_prob <= 1.0):
        raise ValueError(f"min_prob must be in [0, 1], got {min_prob!r}")
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 0):
        raise ValueError(f"factor must be a finite number >= 0, got {factor!r}")
    if not (isinstance(offset, (int, float)) and math.isfinite(offset)):
        raise ValueError(f"offset must be a finite number, got {offset!r}")


def _as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return _EMPTY
    if arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID:
        raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}]")
    return arr.astype(np.int32, copy=False)


def _walk_limit(match_len: int, max_tokens: int, factor: float, offset: float) -> int:
    # Speculate no further than the evidence reaches: factor * m + offset (Arctic's rule).
    return max(0, min(max_tokens, math.floor(factor * match_len + offset))) if match_len else 0


class SuffixIndex:
    """Token sequences keyed by id, with suffix matching; bounded by tokens and bytes."""

    def __init__(self, max_tokens: int, max_depth: int = 32, max_bytes: int | None = None):
        max_tokens = _check_int("max_tokens", max_tokens, 1)
        self.max_depth = _check_int("max_depth", max_depth, 1)
        slot_limit = max_tokens + max_tokens // 2 + 16  # headroom keeps compaction amortized
        token_limit, self._seq_budget = max_tokens, None
        if max_bytes is not None:
            max_bytes = _check_int("max_bytes", max_bytes, 1)
            # An eighth of the budget is kept for per-sequence records, the rest is slots.
            self._seq_budget = max_bytes // 8
            slots = (max_bytes - _FIXED_BYTES - self._seq_budget) // _SLOT_BYTES
            if slots < 8 or self._seq_budget < _SEQ_BYTES + 64:
                raise ValueError(
                    f"max_bytes={max_bytes} is too small: it must hold {_FIXED_BYTES} bytes of"
                    f" structure, 8 token slots of {_SLOT_BYTES} bytes and, in its eighth kept"
                    f" for sequence records, one record of {_SEQ_BYTES + 64} bytes"
                )
            slot_limit = min(slot_limit, slots)
            token_limit = min(token_limit, slots * 2 // 3)
        self.max_tokens, self.max_bytes = token_limit, max_bytes
        self._slot_limit = slot_limit
        self._seqs: dict[Hashable, list[int]] = {}  # id -> [first slot, last slot, length]
        self._seq_bytes = 0
        self._live = 0
        self._end = 0
        self._cap = 0
        self._tok = self._prev = self._next = np.full(1, -1, np.int32)
        self._sorted_key = np.empty(0, np.int64)
        self._sorted_pos = _EMPTY
        self._sorted_end = 0
        self._compact(min(slot_limit - 1, 256))

    # ----- size -----

    @property
    def n_tokens(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        arrays = (self._tok, self._prev, self._next, self._sorted_key, self._sorted_pos)
        return _FIXED_BYTES + sum(a.nbytes for a in arrays) + self._seq_bytes

    def seq_ids(self) -> list[Hashable]:
        """Live sequence ids, oldest first (the eviction order)."""
        return list(self._seqs)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def tokens(self, seq_id: Hashable) -> list[int]:
        return self.tail(seq_id, self._seqs[seq_id][2])

    def tail(self, seq_id: Hashable, n: int) -> list[int]:
        """The last n tokens of a sequence (fewer if it is shorter)."""
        first, last, length = self._seqs[seq_id]
        n = min(n, length)
        if n <= 0:
            return []
        if last - first + 1 == length:  # slots of one sequence only grow: a full range
            return self._tok[last - n + 1 : last + 1].tolist()
        out, slot = [], last
        for _ in range(n):
            out.append(int(self._tok[slot]))
            slot = int(self._prev[slot])
        return out[::-1]

    # ----- updates -----

    def append(self, seq_id: Hashable, tokens: Sequence[int] | np.ndarray) -> None:
        """Add tokens to the end of a sequence, creating it (as the newest) if needed."""
        toks = _as_tokens(tokens)
        rec = self._seqs.get(seq_id)
        if rec is None:
            cost = _SEQ_BYTES + sys.getsizeof(seq_id)
            if self._seq_budget is not None and cost > self._seq_budget:
                raise ValueError(f"sequence id {seq_id!r} alone exceeds the byte budget")
            rec = self._seqs[seq_id] = [-1, -1, 0]
            self._seq_bytes += cost
        n = len(toks)
        if n >= self.max_tokens:  # alone over budget: keep the newest tokens
            toks, n = toks[n - self.max_tokens :], self.max_tokens
            self._kill_front(rec, rec[2])
        elif rec[2] + n > self.max_tokens:
            self._kill_front(rec, rec[2] + n - self.max_tokens)
        self._evict_for(n, keep=seq_id)
        if n:
            self._reserve(n)
            self._write(rec, toks)
            if self._end - self._sorted_end > max(_MIN_TAIL, self._live // 8):
                self._sort()

    def remove(self, seq_id: Hashable) -> bool:
        """Drop a sequence; False if it was not there (never added, removed or evicted)."""
        rec = self._seqs.pop(seq_id, None)
        if rec is None:
            return False
        self._kill_front(rec, rec[2])
        self._seq_bytes -= _SEQ_BYTES + sys.getsizeof(seq_id)
        return True

    def _evict_for(self, n: int, keep: Hashable) -> None:
        # Oldest first, never `keep`: the caller already trimmed it to fit on its own.
        def over() -> bool:
            if self._live + n > self.max_tokens:
                return True
            return self._seq_budget is not None and self._seq_bytes > self._seq_budget

        while over():
            victim = next((s for s in self._seqs if s != keep), None)
            if victim is None:
                return
            self.remove(victim)

    def _write(self, rec: list[int], toks: np.ndarray) -> None:
        start, n = self._end, len(toks)
        stop = start + n
        self._tok[start:stop] = toks
        self._prev[start] = rec[1]
        self._prev[start + 1 : stop] = np.arange(start, stop - 1, dtype=np.int32)
        self._next[start : stop - 1] = np.arange(start + 1, stop, dtype=np.int32)
        self._next[stop - 1] = -1
        if rec[2]:
            self._next[rec[1]] = start
        else:
            rec[0] = start
        rec[1] = stop - 1
        rec[2] += n
        self._live += n
        self._end = stop

    def _kill_front(self, rec: list[int], k: int) -> None:
        """Mark the first k tokens of a sequence dead (tok = next = -1)."""
        k = min(k, rec[2])
        if k <= 0:
            return
        first = rec[0]
        if rec[1] - first + 1 == rec[2]:  # one contiguous range: slice writes
            self._tok[first : first + k] = -1
            self._next[first : first + k] = -1
            slot = first + k
        else:
            slot = first
            for _ in range(k):
                after = int(self._next[slot])
                self._tok[slot] = self._next[slot] = -1
                slot = after
        rec[2] -= k
        self._live -= k
        if rec[2]:
            self._prev[slot] = -1
            rec[0] = slot
        else:
            rec[0] = rec[1] = -1

    def _reserve(self, n: int) -> None:
        if self._end + n <= self._cap:
            return
        needed = self._live + n
        new_cap = self._cap
        if needed > self._cap * 2 // 3:  # compacting alone would leave too little headroom
            new_cap = max(2 * self._cap, needed + needed // 2)
        self._compact(min(new_cap, self._slot_limit - 1))

    def _compact(self, cap: int) -> None:
        """Move the live slots to the front of fresh arrays of cap (+1 sentinel) slots."""
        live = np.flatnonzero(self._tok[: self._end] >= 0)
        remap = np.full(self._end + 1, -1, np.int32)  # remap[-1] = -1 keeps "none" as -1
        remap[live] = np.arange(len(live), dtype=np.int32)
        arrays = []
        for old in (self._tok, self._prev, self._next):
            new = np.full(cap + 1, -1, np.int32)
            new[: len(live)] = old[live] if old is self._tok else remap[old[live]]
            arrays.append(new)
        self._tok, self._prev, self._next = arrays
        for rec in self._seqs.values():
            if rec[2]:
                rec[0], rec[1] = int(remap[rec[0]]), int(remap[rec[1]])
        self._cap, self._end = cap, len(live)
        self._sort()

    def _sort(self) -> None:
        """Rebuild the sorted index over every live slot (the tail becomes empty)."""
        slots = np.flatnonzero(self._tok[: self._end] >= 0).astype(np.int32)
        back1 = self._prev[slots]
        back2 = self._prev[back1]  # prev of the sentinel is -1: shorter contexts key as 0
        key = self._tok[slots].astype(np.int64) << (2 * _BITS)
        key |= (self._tok[back1].astype(np.int64) + 1) << _BITS
        key |= self._tok[back2].astype(np.int64) + 1
        order = np.argsort(key, kind="stable")
        self._sorted_key, self._sorted_pos = key[order], slots[order]
        self._sorted_end = self._end

    # ----- queries -----

    def _context(self, context: Sequence[int] | np.ndarray) -> list[int]:
        ctx = [int(t) for t in context[max(0, len(context) - self.max_depth) :]]
        if ctx and (min(ctx) < 0 or max(ctx) > MAX_TOKEN_ID):
            raise ValueError(f"context token ids must be in [0, {MAX_TOKEN_ID}]")
        return ctx

    def _candidates(self, ctx: list[int], k: int, tail: np.ndarray) -> np.ndarray:
        """Continued slots whose last k tokens may equal ctx's (a superset: keys can be stale
        after a front trim), plus the unsorted tail's slots ending in ctx[-1]."""
        lo = ctx[-1] << (2 * _BITS)
        width = 1 << (2 * _BITS)
        if k >= 2:
            lo |= (ctx[-2] + 1) << _BITS
            width = 1 << _BITS
        if k >= 3:
            lo |= ctx[-3] + 1
            width = 1
        i, j = np.searchsorted(self._sorted_key, (lo, lo + width))
        cand = self._sorted_pos[i:j]
        if tail.size:
            cand = np.concatenate((cand, tail))
        return cand[self._next[cand] >= 0]

    def _match(self, ctx: list[int]) -> tuple[int, np.ndarray]:
        """(match length, slots where that matched suffix ends and is continued)."""
        if not ctx:
            return 0, _EMPTY
        tail = self._tok[self._sorted_end : self._end] == ctx[-1]
        tail = (np.flatnonzero(tail) + self._sorted_end).astype(np.int32)
        for k in range(min(3, len(ctx)), 0, -1):
            cand = self._candidates(ctx, k, tail)
            if cand.size:
                length, ends = self._extend(ctx, cand)
                if length >= k:  # else only stale keys matched: a shorter k must be tried
                    return length, ends
        return 0, _EMPTY

    def _extend(self, ctx: list[int], ends: np.ndarray) -> tuple[int, np.ndarray]:
        """Longest run of ctx (read backwards) behind the slots `ends` (all ending in ctx[-1])."""
        tok, prev, n = self._tok, self._prev, len(ctx)
        back, length = ends, 1
        while length < n and ends.size > _SMALL:  # many candidates: filter one step at a time
            behind = prev[back]
            keep = tok[behind] == ctx[-length - 1]
            if not keep.any():
                return length, ends
            ends, back, length = ends[keep], behind[keep], length + 1
        if length == n:
            return length, ends
        rest = n - length
        cols = self._behind(back, rest)
        same = tok[cols] == np.array(ctx[rest - 1 :: -1], np.int32)
        runs = np.where(same.all(axis=1), rest, same.argmin(axis=1))
        best = int(runs.max())
        return (length + best, ends[runs == best]) if best else (length, ends)

    def _behind(self, back: np.ndarray, steps: int) -> np.ndarray:
        """[c, steps] slots 1..steps positions before `back` in their sequences (-1 past the
        start). Sequences usually occupy consecutive slots, so try arithmetic first and check
        it against `prev` in one gather; walk `prev` step by step only where that fails."""
        prev = self._prev
        cols = back[:, None] - np.arange(1, steps + 1, dtype=np.int32)
        ahead = np.concatenate((back[:, None], cols[:, :-1]), axis=1)  # the slot after each
        actual = prev[ahead]
        broken = np.logical_or.accumulate(actual != cols, axis=1)
        # Where the chain breaks, a sequence start (prev -1) just ends the row; a jump to
        # another slot (interleaved appends) needs the walk.
        first = broken & ~np.concatenate((np.zeros_like(broken[:, :1]), broken[:, :-1]), axis=1)
        if (actual[first] == -1).all():
            cols[broken] = -1
            return cols
        for j in range(steps):
            back = prev[back]
            cols[:, j] = back
        return cols

    def _followers(self, ends: np.ndarray, limit: int, min_count: float = 0.0):
        """Next slots of `ends` and up to `limit` (token, count) with count >= min_count,
        ranked by count desc, token asc."""
        after = self._next[ends]
        toks = self._tok[after]
        if toks.size <= 64:
            counts = [tc for tc in Counter(toks.tolist()).items() if tc[1] >= min_count]
            return after, sorted(counts, key=lambda tc: (-tc[1], tc[0]))[:limit]
        values, freq = np.unique(toks, return_counts=True)  # values ascending
        if limit == 1:
            best = int(freq.argmax())  # the first maximum: the smallest token among ties
            ranked = [(int(values[best]), int(freq[best]))]
            return after, ranked if ranked[0][1] >= min_count else []
        keep = freq >= min_count
        values, freq = values[keep], freq[keep]
        order = np.lexsort((values, -freq))[:limit]
        return after, list(zip(values[order].tolist(), freq[order].tolist()))

    def _step(self, after: np.ndarray, token: int) -> np.ndarray:
        """Continued occurrence ends of the pattern extended by `token`."""
        ends = after[self._tok[after] == token]
        return ends[self._next[ends] >= 0]

    def _read_on(self, slot: int, n: int) -> list[int]:
        """Up to n tokens following `slot` in its sequence."""
        out, nxt, tok = [], self._next, self._tok
        for _ in range(n):
            slot = int(nxt[slot])
            if slot < 0:
                break
            out.append(int(tok[slot]))
        return out

    def match(self, context: Sequence[int] | np.ndarray) -> int:
        """Length of the longest suffix of context (<= max_depth) seen with a continuation."""
        return self._match(self._context(context))[0]

    def continuations(self, context: Sequence[int] | np.ndarray) -> dict[int, int]:
        """Next-token counts over every continued occurrence of the longest matched suffix."""
        _, ends = self._match(self._context(context))
        return dict(self._followers(ends, ends.size)[1]) if ends.size else {}

    def propose(
        self,
        context: Sequence[int] | np.ndarray,
        max_tokens: int,
        min_prob: float = 0.1,
        factor: float = 1.0,
        offset: float = 0.0,
    ) -> Proposal:
        """Greedy chain along the most frequent continuations (see the module doc)."""
        max_tokens = _check_int("max_tokens", max_tokens, 1)
        _check_walk_args(min_prob, factor, offset)
        match_len, ends = self._match(self._context(context))
        limit = _walk_limit(match_len, max_tokens, factor, offset)
        out = Proposal([], [], match_len, 0.0)
        cum = 1.0
        while len(out.tokens) < limit and ends.size:
            if ends.size == 1:  # one occurrence left: read its continuation off, prob 1 each
                for token in self._read_on(int(ends[0]), limit - len(out.tokens)):
                    out.tokens.append(token)
                    out.probs.append(1.0)
                    out.score += cum
                break
            after, ranked = self._followers(ends, 1)
            token, count = ranked[0]
            prob = count / ends.size
            if cum * prob < min_prob:
                break
            cum *= prob
            out.tokens.append(token)
            out.probs.append(prob)
            out.score += cum
            ends = self._step(after, token)
        return out

    def propose_tree(
        self,
        context: Sequence[int] | np.ndarray,
        max_nodes: int,
        min_prob: float = 0.1,
        factor: float = 1.0,
        offset: float = 0.0,
        max_depth: int | None = None,
    ) -> TreeProposal:
        """Up to max_nodes draft tokens, the highest cumulative probabilities first.

        Depth is capped by floor(factor * match_len + offset) and max_depth; a node is kept
        only if its cumulative probability is >= min_prob. Since a child's cumulative is at
        most its parent's, best-first yields the max_nodes most probable paths' nodes."""
        max_nodes = _check_int("max_nodes", max_nodes, 1)
        _check_walk_args(min_prob, factor, offset)
        if max_depth is not None:
            max_depth = _check_int("max_depth", max_depth, 1)
        match_len, ends = self._match(self._context(context))
        tree = TreeProposal(match_len=match_len)
        depth_cap = _walk_limit(match_len, max_depth or max_nodes, factor, offset)
        if depth_cap < 1 or not ends.size:
            return tree
        heap: list = []
        order = itertools.count()
        self._push_children(heap, order, (-1, 0, 1.0, ends), min_prob, max_nodes)
        while heap and len(tree.tokens) < max_nodes:
            neg_cum, _, parent, depth, token, prob, child_ends = heapq.heappop(heap)
            tree.tokens.append(token)
            tree.parents.append(parent)
            tree.depths.append(depth)
            tree.probs.append(prob)
            tree.cum_probs.append(-neg_cum)
            tree.score += -neg_cum
            if depth < depth_cap and child_ends.size:
                node = (len(tree.tokens) - 1, depth, -neg_cum, child_ends)
                self._push_children(heap, order, node, min_prob, max_nodes)
        return tree

    def _push_children(self, heap: list, order, node: tuple, min_prob: float, limit: int):
        index, depth, cum, ends = node
        total = ends.size
        # More than `limit` children can never all be taken; below min_count, cum < min_prob.
        min_count = min_prob * total / cum * (1 - 1e-9)
        after, ranked = self._followers(ends, limit, min_count)
        for token, count in ranked:
            prob = count / total
            child_cum = cum * prob
            if child_cum < min_prob:
                break  # ranked by count: the rest are no more probable
            entry = (-child_cum, next(order), index, depth + 1, token, prob)
            heapq.heappush(heap, (*entry, self._step(after, token)))


@dataclass
class _Request:
    index: SuffixIndex
    prompt_len: int
    total: int  # tokens appended so far (the index may have trimmed its front)
    pool: Hashable = None  # the shared index it drafts from and joins


class SuffixProposer:
    """One SuffixIndex per request plus shared ones; proposes from the better of the request's
    and its pool's (pool None: the global index; other pools, e.g. one per tenant, are made on
    first use, each with the global index's budget, and never see each other's sequences).

    On `finish`, the request's output, preceded by the last `prompt_tail` prompt tokens
    (default max_depth), enters the global index as one sequence. The prompt tail lets a
    re-asked or templated prompt match at once and continue into the earlier answer; more of
    the prompt would fill the budget with text the request index already covers."""

    def __init__(
        self,
        max_global_tokens: int = 200_000,
        *,
        max_global_bytes: int | None = None,
        max_request_tokens: int = 8192,
        max_depth: int = 32,
        prompt_tail: int | None = None,
    ):
        self._pool_args = (max_global_tokens, max_depth, max_global_bytes)
        self.pools: dict[Hashable, SuffixIndex] = {None: SuffixIndex(*self._pool_args)}
        # global key -> (pool, the caller's tag): what `forget` matches a finished output by.
        self._tags: dict[int, tuple[Hashable, Any]] = {}
        self._prune_at = 64
        self._max_request_tokens = _check_int("max_request_tokens", max_request_tokens, 1)
        self.max_depth = self.pools[None].max_depth
        tail = self.max_depth if prompt_tail is None else prompt_tail
        self.prompt_tail = _check_int("prompt_tail", tail, 0)
        self._requests: dict[Hashable, _Request] = {}
        self._finished = itertools.count()  # global keys: a reused request id must not merge

    @property
    def global_index(self) -> SuffixIndex:
        return self.pools[None]

    def pool(self, pool: Hashable) -> SuffixIndex:
        index = self.pools.get(pool)
        if index is None:
            index = self.pools[pool] = SuffixIndex(*self._pool_args)
        return index

    def start(self, req_id: Hashable, prompt_ids: Sequence[int] | np.ndarray, pool: Hashable = None) -> None:
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} already started")
        index = SuffixIndex(self._max_request_tokens, self.max_depth)
        index.append(0, prompt_ids)
        self._requests[req_id] = _Request(index, len(prompt_ids), len(prompt_ids), pool)

    def extend(self, req_id: Hashable, tokens: Sequence[int] | np.ndarray) -> None:
        req = self._requests[req_id]
        req.index.append(0, tokens)
        req.total += len(tokens)

    def finish(self, req_id: Hashable, add_to_global: bool, tag: Any = None) -> None:
        """Forget the request; add its prompt tail + output to its pool's index unless the
        request opted out of capture (add_to_global=False). `tag`: what `forget` matches it by."""
        req = self._requests.pop(req_id)
        if add_to_global:
            keep = req.total - req.prompt_len + self._tail_len(req.prompt_len)
            self._add(req.pool, req.index.tail(0, keep), tag)

    def remember(self, prompt_ids: Sequence[int] | np.ndarray, output_ids: Sequence[int] | np.ndarray,
                 pool: Hashable = None, tag: Any = None) -> None:
        """Add a finished request served elsewhere (a record from the stream), as `finish` adds
        one served here."""
        tail = list(prompt_ids)[len(prompt_ids) - self._tail_len(len(prompt_ids)):]
        self._add(pool, tail + list(output_ids), tag)

    def _add(self, pool: Hashable, tokens: list[int], tag: Any) -> None:
        key = next(self._finished)
        self.pool(pool).append(key, tokens)
        if tag is not None:
            self._tags[key] = (pool, tag)
            if len(self._tags) > self._prune_at:
                # Evicted sequences leave their tags behind: drop those, when the tags have doubled.
                self._tags = {k: t for k, t in self._tags.items() if k in self.pools[t[0]]}
                self._prune_at = 2 * len(self._tags) + 64

    def forget(self, matches: Callable[[Any], bool]) -> int:
        """Remove every shared sequence whose tag `matches(tag)` (deletion of records); returns
        how many were still there."""
        removed = 0
        for key, (pool, tag) in list(self._tags.items()):
            if matches(tag):
                removed += self.pools[pool].remove(key)
                del self._tags[key]
        return removed

    def _tail_len(self, prompt_len: int) -> int:
        """Prompt tokens kept before a finished output in the global index: the last
        `prompt_tail` of them (all of a shorter prompt)."""
        return min(self.prompt_tail, prompt_len)

    def _best(self, req_id: Hashable, context, walk: str, args: tuple):
        """Run `walk` ("propose" or "propose_tree") on both indexes and keep the higher score
        (the request's on a tie: its text is this conversation's own)."""
        req = self._requests[req_id]
        ctx = req.index.tail(0, self.max_depth) if context is None else context
        local = getattr(req.index, walk)(ctx, *args)
        shared = getattr(self.pool(req.pool), walk)(ctx, *args)
        best = shared if shared.score > local.score else local
        best.source = "global" if best is shared else "request"
        return best

    def propose(
        self,
        req_id: Hashable,
        context: Sequence[int] | np.ndarray | None = None,
        max_tokens: int = 8,
        min_prob: float = 0.1,
        factor: float = 1.0,
        offset: float = 0.0,
    ) -> Proposal:
        """The better chain of the request's and the global index; context defaults to the
        request's tokens so far."""
        return self._best(req_id, context, "propose", (max_tokens, min_prob, factor, offset))

    def propose_tree(
        self,
        req_id: Hashable,
        context: Sequence[int] | np.ndarray | None = None,
        max_nodes: int = 16,
        min_prob: float = 0.1,
        factor: float = 1.0,
        offset: float = 0.0,
        max_depth: int | None = None,
    ) -> TreeProposal:
        """As `propose`, for trees."""
        args = (max_nodes, min_prob, factor, offset, max_depth)
        return self._best(req_id, context, "propose_tree", args)
