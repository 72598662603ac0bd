"""serve/spec_decode/suffix/index.py: suffix index and proposer against a brute-force reference."""

import heapq
import itertools
import math
import random
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve.spec_decode.suffix.index import SuffixIndex, SuffixProposer

pytestmark = pytest.mark.pure

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class RefIndex:
    """Plain lists with the documented eviction rule; queries by scanning everything."""

    def __init__(self, max_tokens, max_depth):
        self.max_tokens, self.max_depth = max_tokens, max_depth
        self.seqs = {}

    def append(self, sid, toks):
        toks = list(toks)
        seq = self.seqs.setdefault(sid, [])
        if len(toks) >= self.max_tokens:
            seq.clear()
            toks = toks[len(toks) - self.max_tokens :]
        elif len(seq) + len(toks) > self.max_tokens:
            del seq[: len(seq) + len(toks) - self.max_tokens]
        while sum(map(len, self.seqs.values())) + len(toks) > self.max_tokens:
            del self.seqs[next(s for s in self.seqs if s != sid)]
        seq.extend(toks)

    def remove(self, sid):
        return self.seqs.pop(sid, None) is not None

    def followers(self, pattern):
        """Next-token counts over occurrences of pattern that are followed by a token."""
        counts, k = {}, len(pattern)
        for seq in self.seqs.values():
            for i in range(len(seq) - k):
                if seq[i : i + k] == pattern:
                    counts[seq[i + k]] = counts.get(seq[i + k], 0) + 1
        return counts

    def match(self, ctx):
        ctx = list(ctx)[-self.max_depth :] if ctx else []
        for length in range(len(ctx), 0, -1):
            counts = self.followers(ctx[len(ctx) - length :])
            if counts:
                return length, counts
        return 0, {}

    def chain(self, ctx, max_tokens, min_prob, factor, offset):
        m, _ = self.match(ctx)
        limit = max(0, min(max_tokens, math.floor(factor * m + offset))) if m else 0
        pattern = list(ctx)[len(ctx) - m :] if m else []
        tokens, probs, cum, score = [], [], 1.0, 0.0
        while len(tokens) < limit:
            counts = self.followers(pattern)
            if not counts:
                break
            token = min(counts, key=lambda t: (-counts[t], t))
            prob = counts[token] / sum(counts.values())
            if cum * prob < min_prob:
                break
            cum *= prob
            tokens.append(token)
            probs.append(prob)
            score += cum
            pattern.append(token)
        return tokens, probs, m, score

    def tree(self, ctx, max_nodes, min_prob, factor, offset):
        m, _ = self.match(ctx)
        cap = max(0, min(max_nodes, math.floor(factor * m + offset))) if m else 0
        out = []  # (token, parent, prob, cum)
        heap, order = [], itertools.count()

        def push(pattern, index, depth, cum):
            counts = self.followers(pattern)
            total = sum(counts.values())
            ranked = sorted(counts.items(), key=lambda tc: (-tc[1], tc[0]))[:max_nodes]
            for token, count in ranked:
                prob = count / total
                if cum * prob >= min_prob:
                    entry = (-cum * prob, next(order), index, depth, token, prob)
                    heapq.heappush(heap, (*entry, pattern + [token]))

        if cap >= 1:
            push(list(ctx)[len(ctx) - m :], -1, 1, 1.0)
        while heap and len(out) < max_nodes:
            neg, _, parent, depth, token, prob, pattern = heapq.heappop(heap)
            out.append((token, parent, prob, -neg))
            if depth < cap:
                push(pattern, len(out) - 1, depth + 1, -neg)
        return out


def check_against(idx, ref, ctx, walk):
    m, counts = ref.match(ctx)
    assert idx.match(ctx) == m
    assert idx.continuations(ctx) == counts
    max_tokens, min_prob, factor, offset = walk
    got = idx.propose(ctx, max_tokens, min_prob, factor, offset)
    tokens, probs, m2, score = ref.chain(ctx, max_tokens, min_prob, factor, offset)
    assert (got.tokens, got.match_len) == (tokens, m2)
    assert got.probs == pytest.approx(probs)
    assert got.score == pytest.approx(score)
    tree = idx.propose_tree(ctx, max_tokens, min_prob, factor, offset)
    want = ref.tree(ctx, max_tokens, min_prob, factor, offset)
    assert list(zip(tree.tokens, tree.parents)) == [(t, p) for t, p, _, _ in want]
    assert tree.cum_probs == pytest.approx([c for *_, c in want])
    assert tree.probs == pytest.approx([p for _, _, p, _ in want])


ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 4), st.lists(st.integers(0, 3), max_size=12)),
        st.tuples(st.just("remove"), st.integers(0, 4), st.just([])),
    ),
    max_size=14,
)
walks = st.tuples(
    st.integers(1, 6),
    st.sampled_from([0.0, 0.05, 0.1, 0.3, 0.6, 1.0]),
    st.sampled_from([0.5, 1.0, 2.0, 4.0]),
    st.sampled_from([-1.0, 0.0, 1.0, 3.0]),
)


@FAST
@given(
    st.integers(1, 40),
    st.integers(1, 6),
    ops,
    st.lists(st.lists(st.integers(0, 3), max_size=9), min_size=1, max_size=4),
    walks,
)
def test_matches_brute_force_after_any_operations(max_tokens, depth, operations, contexts, walk):
    idx, ref = SuffixIndex(max_tokens, depth), RefIndex(max_tokens, depth)
    for op, sid, toks in operations:
        if op == "append":
            idx.append(sid, toks)
            ref.append(sid, toks)
        else:
            assert idx.remove(sid) == ref.remove(sid)
        assert idx.seq_ids() == list(ref.seqs)
        assert {s: idx.tokens(s) for s in idx.seq_ids()} == ref.seqs
        assert idx.n_tokens == sum(map(len, ref.seqs.values())) <= max_tokens
    for ctx in contexts:
        check_against(idx, ref, ctx, walk)


def test_larger_random_runs_through_sorting_compaction_and_interleaving():
    # Thousands of tokens over a 3-letter alphabet: the sorted index, its tail, stale keys
    # after front trims, compaction and interleaved (non-contiguous) sequences all get used.
    rng = random.Random(7)
    idx, ref = SuffixIndex(1500, 12), RefIndex(1500, 12)
    for step in range(400):
        sid = rng.randrange(12)
        if rng.random() < 0.05:
            assert idx.remove(sid) == ref.remove(sid)
        else:
            toks = [rng.randrange(3) for _ in range(rng.choice([1, 2, 5, 40]))]
            idx.append(sid, toks)
            ref.append(sid, toks)
        if step % 40 == 39:
            assert {s: idx.tokens(s) for s in idx.seq_ids()} == ref.seqs
            for _ in range(3):
                seq = ref.seqs[rng.choice(list(ref.seqs))] or [0]
                cut = rng.randrange(len(seq) + 1)
                ctx = seq[max(0, cut - 14) : cut] + [rng.randrange(3)] * rng.randrange(2)
                check_against(idx, ref, ctx, (6, 0.0, 1.0, 2.0))
    assert idx.n_tokens <= 1500


def test_tree_shape_and_best_first():
    rng = random.Random(3)
    idx = SuffixIndex(10_000, 8)
    for s in range(20):
        idx.append(s, [rng.randrange(4) for _ in range(60)])
    for _ in range(30):
        ctx = [rng.randrange(4) for _ in range(5)]
        tree = idx.propose_tree(ctx, max_nodes=12, min_prob=0.02, factor=3.0)
        assert len(tree.tokens) <= 12
        for i, parent in enumerate(tree.parents):
            assert -1 <= parent < i
            parent_cum = 1.0 if parent < 0 else tree.cum_probs[parent]
            assert tree.cum_probs[i] == pytest.approx(parent_cum * tree.probs[i])
            assert tree.cum_probs[i] <= parent_cum + 1e-12
            assert tree.depths[i] == (1 if parent < 0 else tree.depths[parent] + 1)
            assert tree.cum_probs[i] >= 0.02
        assert tree.score == pytest.approx(sum(tree.cum_probs))
        # siblings are distinct tokens and their conditional probs sum to at most 1
        for parent in set(tree.parents):
            kids = [i for i, p in enumerate(tree.parents) if p == parent]
            assert len({tree.tokens[i] for i in kids}) == len(kids)
            assert sum(tree.probs[i] for i in kids) <= 1 + 1e-9


def test_eviction_is_oldest_first_and_spares_the_growing_sequence():
    idx = SuffixIndex(10)
    idx.append("a", [1, 2, 3])
    idx.append("b", [4, 5, 6])
    idx.append("c", [7, 8])
    idx.append("a", [9])  # appending to a does not make it newer
    assert idx.seq_ids() == ["a", "b", "c"]
    idx.append("d", [1, 1])  # 9 + 2 > 10: a (oldest) goes
    assert idx.seq_ids() == ["b", "c", "d"]
    idx.append("c", [0] * 7)  # c grows to 9: b then d must go, c itself stays
    assert idx.seq_ids() == ["c"] and idx.tokens("c") == [7, 8] + [0] * 7
    idx.append("c", list(range(12)))  # alone over budget: its newest 10 tokens are kept
    assert idx.tokens("c") == list(range(2, 12)) and idx.n_tokens == 10


def test_remove_forgets_and_reports():
    idx = SuffixIndex(100)
    idx.append(1, [5, 6, 7, 5, 6, 8])
    idx.append(2, [5, 6, 9])
    assert idx.continuations([5, 6]) == {7: 1, 8: 1, 9: 1}
    assert idx.remove(1) is True and idx.remove(1) is False
    assert 1 not in idx and idx.n_tokens == 3
    assert idx.match([5, 6]) == 2 and idx.continuations([5, 6]) == {9: 1}
    assert idx.remove(2) and idx.match([5, 6]) == 0 and idx.propose([5, 6], 4).tokens == []


def test_incremental_append_equals_bulk_append():
    rng = random.Random(11)
    seqs = {s: [rng.randrange(5) for _ in range(rng.randrange(1, 300))] for s in range(6)}
    bulk, step = SuffixIndex(5000, 10), SuffixIndex(5000, 10)
    for s, toks in seqs.items():
        bulk.append(s, toks)
    for s, toks in seqs.items():
        i = 0
        while i < len(toks):
            k = rng.choice([1, 1, 2, 7])
            step.append(s, toks[i : i + k])
            i += k
    assert bulk.seq_ids() == step.seq_ids() and bulk.n_tokens == step.n_tokens
    for _ in range(50):
        ctx = [rng.randrange(5) for _ in range(rng.randrange(1, 12))]
        assert bulk.propose(ctx, 8, 0.0, 2.0) == step.propose(ctx, 8, 0.0, 2.0)
        assert bulk.propose_tree(ctx, 10, 0.0, 2.0) == step.propose_tree(ctx, 10, 0.0, 2.0)


@FAST
@given(st.integers(3000, 20_000), st.integers(1, 2000), st.data())
def test_byte_and_token_budgets_hold_after_every_operation(max_bytes, max_tokens, data):
    idx = SuffixIndex(max_tokens, 8, max_bytes=max_bytes)
    rng = random.Random(data.draw(st.integers(0, 1000)))
    for _ in range(60):
        sid = rng.randrange(40)
        if rng.random() < 0.1:
            idx.remove(sid)
        else:
            idx.append(sid, [rng.randrange(50) for _ in range(rng.choice([0, 1, 3, 30, 400]))])
        assert idx.nbytes <= max_bytes
        assert idx.n_tokens <= min(max_tokens, idx.max_tokens)
    idx.propose([1, 2, 3], 4)


def test_nbytes_is_an_honest_upper_estimate():
    # nbytes must cover what the structure really allocates, without overstating it much.
    rng = np.random.default_rng(0)
    for n_seqs, length in [(1, 3000), (50, 200), (1500, 3)]:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        idx = SuffixIndex(10**6)
        for s in range(n_seqs):
            idx.append(s, rng.integers(0, 50_000, length))
        used = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert used <= idx.nbytes <= 1.3 * used, (n_seqs, length, used, idx.nbytes)


def test_match_is_capped_by_max_depth_and_the_chain_by_factor_and_offset():
    idx = SuffixIndex(1000, max_depth=4)
    text = list(range(20))
    idx.append(0, text)
    assert idx.match(text[:10]) == 4
    assert idx.propose(text[:10], 50).tokens == text[10:14]  # factor 1: as many as matched
    assert idx.propose(text[:10], 50, factor=0.5, offset=1).tokens == text[10:13]
    assert idx.propose(text[:10], 2).tokens == text[10:12]
    assert idx.propose(text[:10], 50, factor=10).tokens == text[10:20]  # the walk runs on
    assert idx.propose(text, 50).tokens == []  # the end of the sequence has no continuation


def test_chain_probabilities_and_min_prob():
    idx = SuffixIndex(1000)
    for tail in ([3, 4], [3, 4], [3, 5], [6, 7]):
        idx.append(len(idx.seq_ids()), [1, 2] + tail)
    prop = idx.propose([9, 1, 2], 2, min_prob=0.0)
    assert prop.tokens == [3, 4] and prop.probs == pytest.approx([0.75, 2 / 3])
    assert prop.score == pytest.approx(0.75 + 0.5) and prop.match_len == 2
    assert idx.propose([9, 1, 2], 2, min_prob=0.6).tokens == [3]
    assert idx.propose([9, 1, 2], 2, min_prob=0.8).tokens == []
    idx.append("more", [8, 1, 2, 6, 7, 1, 2, 6])
    assert idx.continuations([1, 2]) == {3: 3, 6: 3}
    assert idx.propose([1, 2], 1, min_prob=0.0).tokens == [3]  # a tie goes to the smaller id


def test_empty_and_short_contexts_propose_nothing():
    idx = SuffixIndex(100)
    assert idx.propose([1, 2], 4).tokens == [] and idx.match([]) == 0
    idx.append(0, [1, 2, 3])
    for ctx in ([], [7], [3], np.array([], np.int64)):
        prop = idx.propose(ctx, 4)
        assert prop.tokens == [] and prop.score == 0.0
        assert idx.propose_tree(ctx, 4).tokens == []
    assert idx.propose(np.array([1, 2]), 4, factor=0.0, offset=0.0).tokens == []


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: SuffixIndex(0), "max_tokens"),
        (lambda: SuffixIndex(10, max_depth=0), "max_depth"),
        (lambda: SuffixIndex(10, max_bytes=100), "max_bytes"),
        (lambda: SuffixIndex(10).propose([1], 0), "max_tokens"),
        (lambda: SuffixIndex(10).propose([1], 2, min_prob=1.5), "min_prob"),
        (lambda: SuffixIndex(10).propose([1], 2, min_prob=-0.1), "min_prob"),
        (lambda: SuffixIndex(10).propose([1], 2, factor=-1), "factor"),
        (lambda: SuffixIndex(10).propose([1], 2, offset=math.nan), "offset"),
        (lambda: SuffixIndex(10).propose_tree([1], 0), "max_nodes"),
        (lambda: SuffixIndex(10).propose([-1], 2), "context token"),
        (lambda: SuffixIndex(10).append(0, [1, -2]), "token ids"),
        (lambda: SuffixIndex(10).append(0, [1.5]), "integers"),
        (lambda: SuffixIndex(10).append(0, [[1]]), "one-dimensional"),
        (lambda: SuffixProposer(max_request_tokens=0), "max_request_tokens"),
    ],
)
def test_bad_arguments_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_proposer_takes_the_higher_score_and_tags_it():
    prop = SuffixProposer(1000, max_depth=8)
    prop.start("old", [1, 2, 3])
    prop.extend("old", [10, 11, 12, 13, 14, 15])
    prop.finish("old", add_to_global=True)
    prop.start("new", [1, 2, 3])  # a re-asked prompt: only the global index knows what follows
    best = prop.propose("new", max_tokens=4)
    assert best.source == "global" and best.tokens == [10, 11, 12]
    prop.extend("new", [10, 20, 21, 10, 20])  # now its own text predicts 21 after [10, 20]
    best = prop.propose("new", max_tokens=4)
    assert best.source == "request" and best.tokens == [21, 10]
    local = prop._requests["new"].index.propose([10, 20], 4)
    shared = prop.global_index.propose([10, 20], 4)
    assert best.score == max(local.score, shared.score)
    tree = prop.propose_tree("new", context=[3, 10, 11], max_nodes=4)
    assert tree.source == "global" and tree.tokens == [12, 13, 14]
    assert prop.propose_tree("new", max_nodes=4).source == "request"


def test_proposer_never_learns_from_opted_out_requests():
    prop = SuffixProposer(1000, max_depth=8)
    prop.start("private", [1, 2, 3])
    prop.extend("private", [40, 41, 42, 43])
    assert prop.propose("private", context=[1, 2, 3, 40]).tokens == [41, 42, 43]  # its own text
    assert prop.propose("private").tokens == []  # its end has not repeated yet
    prop.finish("private", add_to_global=False)
    assert prop.global_index.n_tokens == 0
    prop.start("other", [1, 2, 3, 40])
    assert prop.propose("other").tokens == []
    prop.finish("other", add_to_global=True)
    with pytest.raises(KeyError):
        prop.propose("private")
    with pytest.raises(ValueError, match="already started"):
        prop.start("x", [1]) or prop.start("x", [1])


def test_proposer_global_keeps_the_prompt_tail_and_output():
    prop = SuffixProposer(1000, max_depth=4)
    prop.start("r", list(range(100, 110)))
    prop.extend("r", [1, 2])
    prop.finish("r", add_to_global=True)
    (sid,) = prop.global_index.seq_ids()
    assert prop.global_index.tokens(sid) == [106, 107, 108, 109, 1, 2]
