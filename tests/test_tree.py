"""serve/spec_decode/trees/dynamic.py: dynamic draft trees (EAGLE-2), their mask, verification and KV compaction."""

import random

import pytest
import torch

from chi2 import chi2_pvalue
from serve.spec_decode.trees.dynamic import (
    DraftTree,
    ancestor_matrix,
    compact_kv_,
    compaction_indices,
    expand_tree,
    sample_children,
    tree_attention,
    verify_tree_greedy,
    verify_tree_sampling,
)

pytestmark = pytest.mark.pure


def _tree(parents, tokens, q=None, logp=None):
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    n = len(parents)
    logp = torch.zeros(n) if logp is None else torch.tensor(logp)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depth), logp, q)


def _random_parents(n, rng):
    return [-1] + [rng.randrange(i) for i in range(1, n)]


#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
#   |
#   6
HAND_PARENTS = [-1, 0, 0, 1, 1, 2, 3]


# ---------------------------------------------------------------- attention


def test_tree_attention_hand_built_tree():
    tree = _tree(HAND_PARENTS, [10, 11, 12, 13, 14, 15, 16])
    mask, pos, anc = tree_attention(tree, prefix_len=3, max_len=12)
    # slots 0-2: prefix; 3-9: nodes 0-6; 10-11: free
    expected = [
        "111100000000",  # node 0: root
        "111110000000",  # node 1: 0, 1
        "111101000000",  # node 2: 0, 2
        "111110100000",  # node 3: 0, 1, 3
        "111110010000",  # node 4: 0, 1, 4
        "111101001000",  # node 5: 0, 2, 5
        "111110100100",  # node 6: 0, 1, 3, 6
    ]
    assert mask.tolist() == [[c == "1" for c in row] for row in expected]
    assert pos.tolist() == [3, 4, 4, 5, 5, 5, 6]
    assert torch.equal(anc, mask[:, 3:10])


@pytest.mark.parametrize("n,prefix", [(1, 0), (2, 5), (5, 3), (9, 0), (17, 2)])
def test_tree_attention_chain_is_the_causal_mask(n, prefix):
    tree = DraftTree.chain(torch.arange(n))
    max_len = prefix + n + 3
    mask, pos, _ = tree_attention(tree, prefix, max_len)
    causal = torch.ones(max_len, max_len, dtype=torch.bool).tril()
    assert torch.equal(mask, causal[prefix : prefix + n])
    assert torch.equal(pos, torch.arange(prefix, prefix + n))


def test_tree_attention_takes_a_tensor_prefix_len():
    tree = _tree(HAND_PARENTS, [0] * 7)
    got = tree_attention(tree, torch.tensor(4), 16)
    want = tree_attention(tree, 4, 16)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="max_len"):
        tree_attention(tree, 10, 16)


def _ancestors_by_walking(parents):
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    return anc


def test_ancestor_matrix_matches_walking_up():
    rng = random.Random(0)
    cases = [[-1], list(range(-1, 36))]  # a lone root; a 37-deep chain (6 jumping rounds)
    cases += [_random_parents(rng.randrange(1, 20), rng) for _ in range(30)]
    for parents in cases:
        assert torch.equal(ancestor_matrix(torch.tensor(parents)), _ancestors_by_walking(parents)), parents


# ---------------------------------------------------------------- expansion


def _table_step(table, calls=None):
    """step_fn whose draft log-probs depend only on each frontier node's token."""

    def step(frontier, tree):
        if calls is not None:
            calls.append((frontier.tolist(), tree.size))
        return table[tree.tokens[frontier]]

    return step


def test_expand_top1_is_the_greedy_chain():
    table = torch.log_softmax(torch.randn(7, 7, generator=torch.Generator().manual_seed(0)), -1)
    tree = expand_tree(_table_step(table), 3, depth=5, top_k=1, total_tokens=6)
    chain, t = [3], 3
    for _ in range(5):
        t = int(table[t].argmax())
        chain.append(t)
    assert tree.tokens.tolist() == chain
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 4]
    assert tree.depth.tolist() == [0, 1, 2, 3, 4, 5]


# Draft probabilities after each token (rows), chosen without ties among the scores.
HAND_Q = torch.tensor(
    [
        [0.05, 0.50, 0.30, 0.15],  # after 0: top-2 are 1 (0.5), 2 (0.3)
        [0.08, 0.10, 0.20, 0.62],  # after 1: 3, 2
        [0.70, 0.15, 0.10, 0.05],  # after 2: 0, 1
        [0.40, 0.30, 0.20, 0.10],  # after 3: 0, 1
    ]
)


def test_expand_follows_eagle2_rule_on_a_worked_example():
    # Level 1: A=1 (.5), B=2 (.3). Level 2: A3 .31, A2 .10, B0 .21, B1 .045 -> frontier A3, B0.
    # Level 3: A3-0 .124, A3-1 .093, B0-1 .105, B0-2 .063. Best 6 overall: A, A3, B, B0, A3-0, B0-1.
    calls = []
    tree = expand_tree(_table_step(HAND_Q.log(), calls), 0, depth=3, top_k=2, total_tokens=7)
    # Candidate indices while growing: 0 root, 1 A, 2 B, 3 A3, 4 A2, 5 B0, 6 B1, ...
    assert calls == [([0], 1), ([1, 2], 3), ([3, 5], 7)]
    assert tree.tokens.tolist() == [0, 1, 2, 3, 0, 0, 1]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2, 3, 4]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 3, 3]
    probs = torch.tensor([1.0, 0.5, 0.3, 0.31, 0.21, 0.124, 0.105])
    assert torch.allclose(tree.logp, probs.log(), atol=1e-5)
    assert tree.q is None

    small = expand_tree(_table_step(HAND_Q.log()), 0, depth=3, top_k=2, total_tokens=3)
    assert small.tokens.tolist() == [0, 1, 3] and small.parents.tolist() == [-1, 0, 1]
    # A budget above the candidate count keeps all 2 + 4 + 4 of them.
    assert expand_tree(_table_step(HAND_Q.log()), 0, depth=3, top_k=2, total_tokens=100).size == 11
    assert expand_tree(_table_step(HAND_Q.log()), 0, depth=0, top_k=2, total_tokens=5).size == 1


def _check_tree_shape(tree):
    parents, depth = tree.parents.tolist(), tree.depth.tolist()
    assert parents[0] == -1 and depth[0] == 0
    for i in range(1, tree.size):
        assert 0 <= parents[i] < i
        assert depth[i] == depth[parents[i]] + 1


def test_expand_kept_set_is_ancestor_closed_under_ties():
    # Integer log-probs make many exact ties, including 0 (a child scoring equal to its parent).
    rng = torch.Generator().manual_seed(0)
    for trial in range(40):
        v = int(torch.randint(2, 6, (1,), generator=rng))
        table = -torch.randint(0, 3, (v, v), generator=rng).float()
        depth, top_k = trial % 4 + 1, trial % 3 + 1
        total = int(torch.randint(1, 12, (1,), generator=rng))
        tree = expand_tree(_table_step(table), 0, depth, top_k, total)
        _check_tree_shape(tree)  # every kept node's parent is kept, earlier
        full = expand_tree(_table_step(table), 0, depth, top_k, 10**6)
        assert tree.size == min(total, full.size)
        for i in range(1, tree.size):
            step = table[tree.tokens[tree.parents[i]], tree.tokens[i]]
            assert tree.logp[i] == tree.logp[tree.parents[i]] + step
        # Kept scores dominate dropped ones.
        if 1 < tree.size < full.size:
            assert tree.logp[1:].min() >= torch.sort(full.logp[1:], descending=True).values[tree.size - 1]


def test_expand_validates_arguments():
    for bad in [dict(depth=-1), dict(top_k=0), dict(total_tokens=0)]:
        args = dict(depth=2, top_k=2, total_tokens=4) | bad
        with pytest.raises(ValueError):
            expand_tree(_table_step(HAND_Q.log()), 0, **args)


def test_expand_sampled_tree_structure():
    g = torch.Generator().manual_seed(3)
    table = torch.log_softmax(torch.randn(6, 6, generator=g), -1)
    table[:, 5] = float("-inf")  # a token the draft never proposes
    for total in (1, 2, 4, 9, 40):
        tree = expand_tree(_table_step(table), 2, depth=3, top_k=3, total_tokens=total, generator=g)
        _check_tree_shape(tree)
        assert tree.size <= total and tree.q.shape == (tree.size, 6 if tree.size > 1 else 0)
        assert 5 not in tree.tokens.tolist()
        parents = tree.parents.tolist()
        for node in range(tree.size):
            kids = [i for i in range(tree.size) if parents[i] == node]
            assert len(kids) <= 3
            assert len({int(tree.tokens[i]) for i in kids}) == len(kids)  # without replacement
            if kids:  # q row = the distribution the children were drawn from
                assert torch.allclose(tree.q[node], table[tree.tokens[node]].exp())
    # Without a cap every level is full: 3 + 3 * 3 + 3 * 3.
    assert expand_tree(_table_step(table), 2, 3, 3, 10**6, generator=g).size == 1 + 3 + 9 + 9


# ---------------------------------------------------------------- greedy verification


def _walk(parents, tokens, argmax):
    kids = [[i for i in range(len(parents)) if parents[i] == n] for n in range(len(parents))]
    node, path = 0, []
    while True:
        nxt = [c for c in kids[node] if tokens[c] == argmax[node]]
        if not nxt:
            return path, argmax[node]
        node = nxt[0]
        path.append(node)


def test_verify_tree_greedy_hand_built():
    tree = _tree(HAND_PARENTS, [0, 5, 7, 2, 3, 4, 9])
    #              node:   0  1  2  3  4  5  6
    assert verify_tree_greedy(tree, torch.tensor([5, 3, 4, 9, 1, 1, 8])) == ([1, 4], 1)
    assert verify_tree_greedy(tree, torch.tensor([5, 2, 4, 9, 1, 1, 8])) == ([1, 3, 6], 8)
    assert verify_tree_greedy(tree, torch.tensor([7, 2, 4, 9, 1, 6, 8])) == ([2, 5], 6)
    assert verify_tree_greedy(tree, torch.tensor([6, 2, 4, 9, 1, 6, 8])) == ([], 6)
    assert verify_tree_greedy(_tree([-1], [4]), torch.tensor([2])) == ([], 2)


def test_verify_tree_greedy_equals_the_argmax_walk():
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randrange(1, 14)
        parents = _random_parents(n, rng)
        tokens = [rng.randrange(3) for _ in range(n)]  # 3 tokens: matches and twin siblings
        argmax = [rng.randrange(3) for _ in range(n)]
        got = verify_tree_greedy(_tree(parents, tokens), torch.tensor(argmax))
        assert got == _walk(parents, tokens, argmax), (parents, tokens, argmax)


def test_tree_greedy_decoding_equals_target_greedy():
    # Target: argmax depends on the last two tokens. Draft: noisy, often agrees.
    v = 8
    g = torch.Generator().manual_seed(5)
    target = torch.randint(0, v, (v, v), generator=g)  # [prev, last] -> argmax
    draft = torch.randn(v, v, generator=g)
    draft[torch.arange(v), target[0]] += 2.0  # the draft guesses the target as if prev were 0
    step = _table_step(torch.log_softmax(draft, -1))
    want = [1, 2]
    while len(want) < 40:
        want.append(int(target[want[-2], want[-1]]))
    out = [1, 2]
    steps = 0
    while len(out) < 40:
        tree = expand_tree(step, out[-1], depth=3, top_k=2, total_tokens=6)
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        prev = [out[-2] if p < 0 else tokens[p] for p in parents]
        path, nxt = verify_tree_greedy(tree, target[prev, tokens])
        out += [tokens[i] for i in path] + [nxt]
        steps += 1
    assert out[:40] == want
    assert steps < 38  # some drafts were accepted


# ---------------------------------------------------------------- sampling verification


P_ROOT = torch.tensor([0.40, 0.25, 0.15, 0.12, 0.08])
Q_BAD = torch.tensor([0.05, 0.10, 0.15, 0.30, 0.40])  # most mass where p is small


def test_sample_children_draws_without_replacement_in_order():
    g = torch.Generator().manual_seed(0)
    q = torch.tensor([0.5, 0.0, 0.3, 0.2])
    pairs = torch.zeros(4, 4)
    for _ in range(3000):
        kids = sample_children(q, 2, g).tolist()
        assert len(kids) == 2 and kids[0] != kids[1] and 1 not in kids
        pairs[kids[0], kids[1]] += 1
    # P(a then b) = q(a) * q(b) / (1 - q(a))
    expected = q[:, None] * q[None, :] / (1 - q[:, None])
    expected.fill_diagonal_(0)
    assert chi2_pvalue(pairs, expected) > 1e-3
    assert sorted(sample_children(q, 5, g).tolist()) == [0, 2, 3]  # only 3 tokens have mass


def _first_tokens(make_children, trials, seed):
    """First emitted token of a one-level tree under verify_tree_sampling, and the sibling
    position that was accepted (0 = none)."""
    g = torch.Generator().manual_seed(seed)
    v = P_ROOT.shape[0]
    first = torch.zeros(v, dtype=torch.long)
    accepted_at = torch.zeros(4, dtype=torch.long)
    q = torch.cat([Q_BAD[None], torch.zeros(3, v)])
    p = P_ROOT.expand(4, v)
    for _ in range(trials):
        kids = make_children(g)
        m = kids.shape[0]
        tree = DraftTree(torch.cat([torch.zeros(1, dtype=torch.long), kids]), torch.tensor([-1, 0, 0, 0][: m + 1]),
                         torch.tensor([0, 1, 1, 1][: m + 1]), torch.zeros(m + 1), q[: m + 1])
        path, nxt = verify_tree_sampling(tree, p[: m + 1], g)
        first[int(kids[path[0] - 1]) if path else nxt] += 1
        accepted_at[path[0] if path else 0] += 1
    return first, accepted_at


@pytest.mark.parametrize("m", [2, 3])
def test_verify_tree_sampling_first_token_follows_p(m):
    first, accepted_at = _first_tokens(lambda g: sample_children(Q_BAD, m, g), 8000, seed=m)
    # Every branch was taken: each sibling accepted, and all rejected.
    assert (accepted_at[: m + 1] > 300).all()
    assert chi2_pvalue(first, P_ROOT) > 1e-3


def test_topk_children_bias_sampling_verification():
    # The reason expand_tree samples children under sampling: EAGLE-2's top-k children are
    # not a draw from q, and the same rule then misses p badly.
    first, _ = _first_tokens(lambda g: torch.topk(Q_BAD, 2).indices, 4000, seed=0)
    assert chi2_pvalue(first, P_ROOT) < 1e-6


def test_verify_tree_sampling_needs_q():
    with pytest.raises(ValueError, match="generator"):
        verify_tree_sampling(_tree([-1, 0], [0, 1]), P_ROOT.expand(2, 5), None)


# Two-token world: P1/Q1 for the first token, P2/Q2[a] for the token after a.
P1 = torch.tensor([0.30, 0.05, 0.25, 0.30, 0.10])
Q1 = torch.tensor([0.10, 0.40, 0.10, 0.10, 0.30])
P2 = torch.softmax(torch.randn(5, 5, generator=torch.Generator().manual_seed(11)) * 1.5, -1)
Q2 = torch.softmax(torch.randn(5, 5, generator=torch.Generator().manual_seed(12)) * 1.5, -1)


def _world(dist1, dist2, prefix):
    if not prefix:
        return dist1
    return dist2[prefix[0]] if len(prefix) == 1 else torch.full((5,), 0.2)


def _node_prefixes(tree, emitted):
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    prefixes = [list(emitted)]
    for i in range(1, tree.size):
        prefixes.append(prefixes[parents[i]] + [tokens[i]])
    return prefixes


def _sampled_step(emitted, g):
    """One tree step: expand (sampled, capped below the full tree), verify; emitted tokens."""

    def step(frontier, tree):
        pre = _node_prefixes(tree, emitted)
        return torch.stack([_world(Q1, Q2, pre[f]).log() for f in frontier.tolist()])

    root = emitted[-1] if emitted else 0
    # top_k 2, depth 2, cap 4: the root's two children, then one grandchild under the best.
    tree = expand_tree(step, root, depth=2, top_k=2, total_tokens=4, generator=g)
    p = torch.stack([_world(P1, P2, pre) for pre in _node_prefixes(tree, emitted)])
    path, nxt = verify_tree_sampling(tree, p, g)
    return [int(tree.tokens[i]) for i in path] + [nxt], len(path)


def test_verify_tree_sampling_two_levels_joint_follows_p():
    g = torch.Generator().manual_seed(7)
    joint = torch.zeros(5, 5, dtype=torch.long)
    lengths = torch.zeros(3, dtype=torch.long)
    for _ in range(3000):
        out, n_acc = _sampled_step([], g)
        lengths[n_acc] += 1
        if len(out) < 2:  # only a correction: the next step decodes the second token
            out += _sampled_step(out, g)[0]
        joint[out[0], out[1]] += 1
    assert (lengths > 200).all()  # rejections, one and two acceptances all happened
    assert chi2_pvalue(joint, P1[:, None] * P2) > 1e-3


# ---------------------------------------------------------------- compaction


def _kv(prefix_shape=(2, 3), max_len=12, head_dim=4):
    slot = torch.arange(max_len, dtype=torch.float32)[:, None] * 10 + torch.arange(head_dim)
    k = slot.expand(*prefix_shape, max_len, head_dim).clone()
    return k, -k.clone()


def test_compaction_moves_accepted_rows_behind_the_root():
    prefix = 3
    k, v = _kv()
    before_k, before_v = k.clone(), v.clone()
    path = [2, 5]  # of HAND_PARENTS: node 2, then its child 5; slot 5 is both a src and a dst
    src, dst = compaction_indices(prefix, path)
    assert src.tolist() == [5, 8] and dst.tolist() == [4, 5]
    compact_kv_(k, v, src, dst)
    n = len(path)
    kept = prefix + 1 + n
    assert torch.equal(k[..., :prefix + 1, :], before_k[..., :prefix + 1, :])  # prefix and root untouched
    assert torch.equal(k[..., prefix + 1 : kept, :], before_k[..., [prefix + i for i in path], :])
    assert torch.equal(v[..., prefix + 1 : kept, :], before_v[..., [prefix + i for i in path], :])
    assert torch.equal(k[..., kept:, :], before_k[..., kept:, :])  # nothing written past the path
    empty = compaction_indices(prefix, [])
    assert empty[0].numel() == 0 and empty[1].numel() == 0


def test_compact_kv_handles_overlapping_moves():
    # A rotation: every slot is read and written, so any in-order copy would clobber a source.
    k, v = _kv(prefix_shape=(1, 2, 2))
    before = k.clone()
    src, dst = torch.tensor([4, 5, 6]), torch.tensor([5, 6, 4])
    compact_kv_(k, v, src, dst)
    assert torch.equal(k[..., [5, 6, 4], :], before[..., [4, 5, 6], :])
    assert torch.equal(v, -k)
    others = [s for s in range(12) if s not in (4, 5, 6)]
    assert torch.equal(k[..., others, :], before[..., others, :])


def test_chain_of_all_accepted_needs_no_move():
    src, dst = compaction_indices(7, [1, 2, 3])
    assert torch.equal(src, dst)
