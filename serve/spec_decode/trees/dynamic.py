"""Dynamic draft trees (EAGLE-2) for speculative decoding: pure functions over tensors.

No model and no engine: the caller runs the draft (through `step_fn`) and the target, and
these functions turn their outputs into a tree, an attention mask, a verdict and cache moves.
Shapes use N = tree nodes (root included), V = vocab size.

One step of tree speculation, in the engine's stage names:

    propose  expand_tree(step_fn, root, depth, top_k, total_tokens[, generator]) -> DraftTree
    score    tree_attention(tree, prefix_len, max_len): the N nodes are written to cache slots
             prefix_len .. prefix_len + N - 1 in node order, one target forward of N tokens
    verify   verify_tree_greedy(tree, argmax) or verify_tree_sampling(tree, p, generator)
    commit   compact_kv_(k, v, *compaction_indices(prefix_len, path)); the cache then holds
             prefix_len + 1 + len(path) slots (the root stays at prefix_len)

Layout: node 0 is the root (the last committed token); parents[i] < i (topological order), so
a chain (parents = i - 1) is ordinary k-token speculation and gets the plain causal mask.

Lossless by construction:
- greedy: the emitted tokens are the target's argmax along the accepted path;
- sampling: recursive rejection sampling over siblings drawn WITHOUT replacement, with the
  draft distribution renormalised over the tokens not yet tried (see verify_tree_sampling).
  This needs a tree whose children were sampled (expand_tree with a generator, which uses
  sample_children); EAGLE-2's top-k children are not a sample of q and bias the output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from serve.sampling.verify import positional_draw, residual, sample


@dataclass(frozen=True)
class DraftTree:
    """A draft tree in topological order (parents[i] < i; node 0 is the root)."""

    tokens: torch.Tensor  # [N] long; tokens[0] = the last committed token
    parents: torch.Tensor  # [N] long; -1 for the root
    depth: torch.Tensor  # [N] long; root 0
    logp: torch.Tensor  # [N] float; cumulative draft log-prob along the path, root 0
    # [N, V] or None; row i: the draft distribution node i's children were sampled from (only
    # rows of nodes with children matter; a root-only tree may carry [1, 0]). Needed by
    # verify_tree_sampling only.
    q: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # Shapes only: checking parents[i] < i would cost a host sync on every step.
        n = self.tokens.shape[0]
        if self.tokens.dim() != 1 or n < 1:
            raise ValueError(f"tokens must be [N] with N >= 1, got {tuple(self.tokens.shape)}")
        for name in ("parents", "depth", "logp"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"{name} must be [{n}], got {tuple(getattr(self, name).shape)}")
        if self.q is not None and (self.q.dim() != 2 or self.q.shape[0] != n):
            raise ValueError(f"q must be [{n}, V], got {tuple(self.q.shape)}")

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def chain(cls, tokens: torch.Tensor) -> "DraftTree":
        """tokens [N]: root then k linear drafts (plain speculation as a tree; logp left 0)."""
        idx = torch.arange(tokens.shape[0], device=tokens.device)
        return cls(tokens, idx - 1, idx, torch.zeros(tokens.shape[0], device=tokens.device))


# ---------------------------------------------------------------- attention


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """parents [N] -> [N, N] bool: [i, j] is true when j is i or an ancestor of i.

    Pointer jumping: after s rounds row i holds the ancestors at distance < 2**s and hop[i] is
    i's 2**s-th ancestor (the root is its own parent, so hops saturate there). ceil(log2 N)
    rounds reach every depth, a count known from the shape, so nothing waits on the device.
    """
    n = parents.shape[0]
    idx = torch.arange(n, device=parents.device)
    anc = idx[:, None] == idx[None, :]
    hop = parents.clamp(min=0)
    for _ in range((n - 1).bit_length()):
        anc = anc | anc[hop]
        hop = hop[hop]
    return anc


def tree_attention(
    tree: DraftTree, prefix_len: int | torch.Tensor, max_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's mask and positions for scoring the tree in one forward.

    Node i sits in cache slot prefix_len + i and attends to every prefix slot [0, prefix_len)
    and to the slots of its ancestors and itself; its position id is prefix_len + depth[i].
    prefix_len may be a 0-d device tensor (no host sync then).
    Returns (mask [N, max_len] bool, position_ids [N] long, ancestors [N, N] bool).
    """
    n = tree.size
    if isinstance(prefix_len, int) and prefix_len + n > max_len:
        raise ValueError(f"prefix {prefix_len} + {n} tree nodes exceed max_len {max_len}")
    anc = ancestor_matrix(tree.parents)
    col = torch.arange(max_len, device=tree.parents.device)
    node = col - prefix_len  # the tree node held by each slot, when in [0, N)
    in_tree = (node >= 0) & (node < n)
    mask = (anc[:, node.clamp(0, n - 1)] & in_tree) | (col < prefix_len)
    return mask, prefix_len + tree.depth, anc


# ---------------------------------------------------------------- drafting

# step_fn(frontier [F] long node indices into tree_so_far, tree_so_far) -> draft log-probs
# [F, V] for the token after each frontier node. Under sampling these must be the log of the
# distribution the engine wants drafts drawn from (e.g. the draft's warped probs).
StepFn = Callable[[torch.Tensor, DraftTree], torch.Tensor]


def expand_tree(
    step_fn: StepFn,
    root_token: int | torch.Tensor,
    depth: int,
    top_k: int,
    total_tokens: int,
    generator: torch.Generator | None = None,
) -> DraftTree:
    """Grow a draft tree level by level (EAGLE-2), calling step_fn once per level.

    Greedy (generator None), EAGLE-2's rule exactly:
    - level d (1..depth): each frontier node gets its top_k children by draft log-prob, each
      scored by cumulative log-prob (parent's + own); all of them join the candidate tree;
    - the next frontier is the top_k best-scored candidates of level d (the root alone is
      level 0's frontier);
    - at the end the best total_tokens - 1 non-root candidates overall are kept, with the root.
      Ties go to the earlier candidate (lower index). A child scores at most its parent (log-
      probs are clamped to <= 0) and has a higher index, so in that order every parent comes
      before its children: the kept set is ancestor-closed.
    Sampling (generator given): children of a frontier node are sample_children(q, top_k),
    in draw order; the frontier is again the top_k best of the level; the size cap is a
    stopping rule instead of a final cut (levels in order, frontier in rank order, children in
    draw order, stop at total_tokens nodes), because dropping a drawn child for its own score
    would bias sampled verification. The tree carries q.
    Returns the tree in topological order (candidate order: level, frontier rank, child rank).
    """
    if depth < 0 or top_k < 1 or total_tokens < 1:
        raise ValueError(f"need depth >= 0, top_k >= 1, total_tokens >= 1; got {depth}, {top_k}, {total_tokens}")
    root = torch.as_tensor(root_token, dtype=torch.long).view(1)
    tree = DraftTree(root, torch.full_like(root, -1), torch.zeros_like(root), torch.zeros(1, device=root.device))
    frontier = torch.zeros(1, dtype=torch.long, device=root.device)
    q = None
    for d in range(1, depth + 1):
        if frontier.shape[0] == 0 or (generator is not None and tree.size >= total_tokens):
            break
        # The clamp keeps a child from outscoring its parent, which the kept-set proof needs.
        logq = step_fn(frontier, tree).float().clamp(max=0.0)  # [F, V]
        if generator is None:
            lp, tok = logq.topk(min(top_k, logq.shape[-1]), dim=-1)
            par = frontier[:, None].expand_as(tok).reshape(-1)
            tok, lp = tok.reshape(-1), lp.reshape(-1)
        else:
            q = _grown(logq.new_zeros(0, logq.shape[1]) if q is None else q, tree.size)
            q = q.index_copy(0, frontier, logq.exp())
            par, tok, lp = _sample_level(logq, frontier, top_k, total_tokens - tree.size, generator)
        score = tree.logp[par] + lp
        frontier = tree.size + _best(score, top_k)
        tree = DraftTree(
            torch.cat([tree.tokens, tok]),
            torch.cat([tree.parents, par]),
            torch.cat([tree.depth, torch.full_like(tok, d)]),
            torch.cat([tree.logp, score]),
        )
    if generator is None:
        return _prune(tree, total_tokens)
    q = _grown(q, tree.size) if q is not None else torch.zeros(tree.size, 0, device=root.device)
    return dataclasses.replace(tree, q=q)


def sample_children(q_row: torch.Tensor, m: int, generator: torch.Generator | None) -> torch.Tensor:
    """m distinct tokens drawn one after another without replacement from q_row [V] (unnormalised
    is fine), in draw order -> [<= m] long; fewer when q_row has fewer than m nonzero tokens.

    Exponential race: token j arrives at time E_j / q_j with E_j ~ Exp(1) i.i.d. The first
    arrival is j with probability q_j / sum(q) and, by memorylessness, the others then race
    afresh, so the arrival order (largest q_j / E_j first) is sequential sampling without
    replacement: the i-th child is drawn from q renormalised over the tokens not yet drawn.
    """
    q = q_row.float()
    e = torch.empty_like(q).exponential_(generator=generator)
    keys = torch.where(q > 0, q / e, -1.0)  # never draw a zero-probability token
    top = torch.topk(keys, min(m, q.shape[0]))
    return top.indices[top.values > 0]


def _sample_level(
    logq: torch.Tensor, frontier: torch.Tensor, top_k: int, budget: int, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampled children of each frontier node in frontier order, cut once `budget` nodes exist.

    The cut depends only on earlier draws (a stopping rule), never on the dropped child itself.
    Returns (parents, tokens, log-probs), each [n]."""
    rows, toks = [], []
    for f in range(frontier.shape[0]):
        kids = sample_children(logq[f].exp(), top_k, generator)[:budget]
        rows.append(torch.full_like(kids, f))
        toks.append(kids)
        budget -= kids.shape[0]
        if budget <= 0:
            break
    row, tok = torch.cat(rows), torch.cat(toks)
    return frontier[row], tok, logq[row, tok]


def _best(score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k highest scores; a stable sort gives ties to the lower index."""
    return torch.sort(score, descending=True, stable=True).indices[:k]


def _grown(q: torch.Tensor, n: int) -> torch.Tensor:
    """q [n0, V] padded with zero rows to [n, V] (rows of nodes that have no children yet)."""
    return torch.cat([q, q.new_zeros(n - q.shape[0], q.shape[1])])


def _prune(tree: DraftTree, total_tokens: int) -> DraftTree:
    """Keep the root and the best total_tokens - 1 other nodes (ties: lower index), re-indexed."""
    n_keep = min(total_tokens, tree.size)
    best = _best(tree.logp[1:], n_keep - 1) + 1
    keep = torch.cat([best.new_zeros(1), best.sort().values])  # index order stays topological
    remap = torch.full_like(tree.parents, -1)
    remap[keep] = torch.arange(n_keep, device=keep.device)
    par = tree.parents[keep]
    par = torch.where(par >= 0, remap[par.clamp(min=0)], par)
    q = tree.q[keep] if tree.q is not None else None
    return DraftTree(tree.tokens[keep], par, tree.depth[keep], tree.logp[keep], q)


# ---------------------------------------------------------------- verification


def verify_tree_greedy(tree: DraftTree, target_argmax: torch.Tensor) -> tuple[list[int], int]:
    """Accept the longest root path whose every token is the target's argmax at its parent.

    target_argmax: [N] long, the target's argmax after each node. At each node the walk takes
    the first child (lowest index) whose token matches, and stops when none does.
    Returns (path: accepted node indices from the root's child down, root excluded,
    next_token: the target's argmax at the last accepted node, or at the root).
    Vectorised: one host sync at the end.
    """
    n = tree.size
    idx = torch.arange(n, device=tree.tokens.device)
    match = tree.tokens == target_argmax[tree.parents.clamp(min=0)]
    match[0] = True
    # A later sibling with the same token is never reached by the walk.
    twin = (tree.parents[:, None] == tree.parents[None, :]) & (idx[None, :] < idx[:, None]) & match[None, :]
    good = match & ~twin.any(1)
    anc = ancestor_matrix(tree.parents)
    reached = ~(anc & ~good[None, :]).any(1)  # every ancestor-or-self is good: a single chain
    end = torch.where(reached, tree.depth, -1).argmax()
    path = anc[end].nonzero().flatten()[1:]  # ancestors have lower indices: depth order
    return path.tolist(), int(target_argmax[end])


def verify_tree_sampling(
    tree: DraftTree, p: torch.Tensor, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Recursive rejection sampling down a sampled tree (SpecInfer-style, without replacement).

    p: [N, V] warped target probabilities after each node. tree.q[i] is the draft distribution
    node i's children x_1..x_m were drawn from, one after another WITHOUT replacement, in node
    order (sample_children). At a node, with r = p[node] and q_1 = q:
      for i = 1..m: accept x_i with probability min(1, r(x_i) / q_i(x_i)) and descend into it;
                    else r <- norm(max(r - q_i, 0)) and q_{i+1} = q_i with x_i removed, renormalised;
      if none is accepted, the next token is drawn from r and the step ends.
    Returns (path, next_token) as verify_tree_greedy.

    Why the output follows p exactly. Lemma: if x ~ q' and, when x is rejected, the token
    emitted follows r' = norm(max(r - q', 0)), the emitted token follows r:
      P(y) = min(r(y), q'(y)) + (1 - sum min(r, q')) * r'(y) = min(r, q')(y) + max(r - q', 0)(y) = r(y),
    since sum max(r - q', 0) = 1 - sum min(r, q'). Given the earlier siblings and coin flips,
    x_i follows q_i (sampling without replacement), so the lemma applies at each sibling from
    the last (whose fallback draws from r exactly) back to the first, and the node emits p[node].
    A sibling list cut by a stopping rule (whether x_{i+1} exists depends on x_1..x_i only)
    keeps this, as does any number of children fixed before drawing them. On acceptance the
    child's own children were drawn from q at the child, so the argument recurses with p[child].
    With the unrenormalised q for later siblings the lemma's premise fails (x_2 never equals
    x_1) and the output is biased; so are EAGLE-2's top-k children.
    """
    if tree.q is None:
        raise ValueError("sampling verification needs tree.q: expand the tree with a generator")
    tokens = tree.tokens.tolist()
    kids: list[list[int]] = [[] for _ in tokens]
    for i, parent in enumerate(tree.parents.tolist()[1:], start=1):
        kids[parent].append(i)
    node, path = 0, []
    while kids[node]:
        child, r = _try_siblings(kids[node], tokens, p[node], tree.q[node], generator)
        if child is None:
            return path, sample(r, generator)
        path.append(child)
        node = child
    return path, sample(p[node], generator)


def verify_tree_positional(tree: DraftTree, p: torch.Tensor, seed: int, start: int) -> tuple[list[int], int]:
    """A tree of tokens chosen without a draw (the suffix draft's: siblings are distinct
    tokens): at each node the target's own draw for that depth, from the generator fixed by
    (seed, start + depth) as verify_positional fixes a chain's, descending into the child that
    holds it. Every emitted token is the target's draw given its actual prefix, so the output
    follows p whatever the tree held. p: [N, V] warped target probabilities after each node;
    start: the absolute position of the root's row. Returns (path, next_token)."""
    tokens = tree.tokens.tolist()
    kids: list[dict[int, int]] = [{} for _ in tokens]
    for i, parent in enumerate(tree.parents.tolist()[1:], start=1):
        kids[parent].setdefault(tokens[i], i)  # a later twin is never reached, as in the greedy walk
    node, path = 0, []
    while True:
        x = positional_draw(p[node], seed, start + len(path))
        child = kids[node].get(x)
        if child is None:
            return path, x
        path.append(child)
        node = child


def _try_siblings(
    children: list[int], tokens: list[int], r: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None
) -> tuple[int | None, torch.Tensor]:
    """One node's rejection chain: (accepted child or None, the residual r after rejections)."""
    q = q.float() / q.float().sum()
    u = torch.rand(len(children), generator=generator, device=r.device)
    for i, c in enumerate(children):
        x = tokens[c]
        # u < r/q written as u*q < r: no division; q(x) > 0 since x was drawn from q.
        if bool(u[i] * q[x] < r[x]):
            return c, r
        r = residual(r, q)
        q = q.clone()
        q[x] = 0.0  # x can no longer be drawn: the next sibling came from q without it
        q = q / q.sum().clamp_min(torch.finfo(q.dtype).tiny)
    return None, r


# ---------------------------------------------------------------- commit


def compaction_indices(
    prefix_len: int, path: list[int], device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache moves after acceptance: (src [n] long, dst [n] long) slots for the n path nodes.

    Node i was written at slot prefix_len + i. The root (node 0) is already in place at
    prefix_len, so the accepted nodes follow it at prefix_len + 1 .. prefix_len + n, in path
    order. Every dst <= its src (node path[t] has depth t + 1, so index >= t + 1).
    """
    src = prefix_len + torch.tensor(path, dtype=torch.long, device=device)
    dst = prefix_len + 1 + torch.arange(len(path), dtype=torch.long, device=device)
    return src, dst


def compact_kv_(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Move rows src -> dst along the sequence dim (-2) of k and v [..., max_len, head_dim], in place.

    The rows are gathered into a copy before any is written, so overlapping src/dst are safe.
    """
    for cache in (k, v):
        rows = cache.index_select(-2, src)
        cache.index_copy_(-2, dst, rows)
