"""One speculative step with a draft tree (EAGLE-2 style), greedy or sampled.

    expand (draft, one block forward per depth) -> score (target, one forward over the whole
    tree under an ancestor mask) -> verify (walk the target's argmax down the tree, or
    rejection-sample down it) -> commit (compact the accepted path's K/V rows into the prefix)

Slots and positions. With `base` committed tokens the target cache holds base-1 of them and
the root of the tree is the last committed token: tree node i goes to target slot base-1+i
at position base-1+depth(i) (serve/tree.py tree_attention). The draft's rows for expanded
nodes go after its committed rows, at slots recorded per node on the device, and are dropped
after the step: the accepted tokens come back as the next step's input, as with chains.

Both draft families expand the same way:
- a layer draft has seen every committed token; node rows are its forward over the node's
  token at position base-1+depth;
- a head draft (serve/head_runner.py) holds target rows up to base-2; a node's row reads the
  state of the row that proposed it (its parent's row; the root's is the catch-up's last row)
  and the node's token, at position base-2+depth. Its vocabulary is the draft vocabulary,
  mapped to target ids (d2t); other tokens get log-prob -inf.

Greedy expands EAGLE-2's top-k children. Sampling draws each node's children from the
draft's warped distribution q without replacement (expand_tree with the request's generator)
and verifies with the exact multi-draft rule (serve/tree.py verify_tree_sampling): EAGLE-2's
top-k children are not a sample of q, and verifying them by rejection would bias the output.
q and the target's p are warped by the request's temperature, top-k and top-p, as chains do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from serve.head_runner import is_head
from serve.tree import (DraftTree, ancestor_matrix, compact_kv_, compaction_indices, expand_tree, tree_attention,
                        verify_tree_greedy, verify_tree_sampling)
from serve.verify import SamplingParams, warp_probs


@dataclass(frozen=True)
class TreeShape:
    """EAGLE-2's three numbers: nodes verified per step (root included), expansion depth,
    children expanded per level."""

    total: int
    depth: int
    top_k: int

    def __post_init__(self) -> None:
        if self.total < 2 or self.depth < 1 or self.top_k < 1:
            raise ValueError(f"a tree needs total >= 2, depth >= 1 and top_k >= 1, got {self}")

    @classmethod
    def parse(cls, text: str) -> "TreeShape":
        """'TOTAL,DEPTH,TOPK', e.g. '16,4,4'."""
        try:
            total, depth, top_k = (int(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"a tree shape is TOTAL,DEPTH,TOPK (three integers), got {text!r}") from None
        return cls(total, depth, top_k)

    @property
    def max_candidates(self) -> int:
        """Nodes expand_tree can create before its final cut: the root's top_k children, then
        top_k children for each of the top_k frontier nodes per level."""
        return 1 + self.top_k + (self.depth - 1) * self.top_k * self.top_k


class _Rows:
    """Where each expanded node's draft row went, kept on the device (no host sync): the
    block for a frontier sees the draft's committed rows [0, prefix) and its own expanded
    ancestors, itself included. Unexpanded nodes (the root among them: it is in the prefix)
    point at a spare column past the cache, which is cut off."""

    def __init__(self, cache: Any, prefix: int, shape: TreeShape, device: torch.device):
        self.cache, self.prefix = cache, prefix
        self.cols = torch.arange(cache.max_len, device=device)
        self.slot = torch.full((shape.max_candidates,), cache.max_len, dtype=torch.long, device=device)

    def block(self, frontier: torch.Tensor, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
        """(start [1], visible [F, max_len]) for writing the frontier's rows; moves cache.length."""
        start, f, n, L = self.cache.length, frontier.shape[0], tree.size, self.cache.max_len
        self.slot.index_copy_(0, frontier, start + self.cols[:f])
        anc = ancestor_matrix(tree.parents).index_select(0, frontier)  # [F, N]
        seen = torch.zeros(f, L + 1, dtype=torch.bool, device=anc.device)
        seen.scatter_(1, self.slot[:n].unsqueeze(0).expand(f, n), anc)
        self.cache.length = start + f
        return self.cols[start:start + 1], seen[:, :L] | (self.cols < self.prefix)


def _log_q(params: SamplingParams) -> Callable[[torch.Tensor], torch.Tensor]:
    """The draft's log-probabilities the tree is expanded from: plain under greedy (EAGLE-2
    ranks by them), warped like the target's p under sampling (children are drawn from them)."""
    if params.greedy:
        return lambda logits: torch.log_softmax(logits.float(), -1)
    return lambda logits: warp_probs(logits, params).log()


def _layer_expander(draft: Any, seq: Any, base: int, shape: TreeShape) -> Callable:
    cache = seq.dcache
    log_q = _log_q(seq.params.sampling)
    root_logp = log_q(draft.forward(seq.pending(cache), cache)[-1])
    rows = _Rows(cache, base, shape, seq.device)

    def step(frontier: torch.Tensor, tree: DraftTree) -> torch.Tensor:
        if tree.size == 1:  # the root's children: the catch-up forward gave them
            return root_logp.unsqueeze(0)
        start, visible = rows.block(frontier, tree)
        pos = (base - 1) + tree.depth[frontier]
        logits, _ = draft.forward_masked(tree.tokens[frontier], start, pos, visible, cache)
        return log_q(logits)

    return step


def _head_expander(runner: Any, seq: Any, base: int, shape: TreeShape) -> Callable:
    cache, head = seq.dcache, runner.head
    start = cache.length
    g = runner.fuse(seq.feats[start - seq.feat_start:])
    root_logits, root_state = runner.rows(g, seq.to_device(seq.tokens[start + 1:]), cache)
    states = root_state.new_zeros(shape.max_candidates, root_state.shape[-1])
    states[0] = root_state[0]
    rows = _Rows(cache, cache.length, shape, seq.device)
    log_q = _log_q(seq.params.sampling)

    def to_target(logits: torch.Tensor) -> torch.Tensor:
        full = logits.new_full((logits.shape[0], runner.vocab_size), float("-inf"), dtype=torch.float32)
        return full.index_copy_(1, head.d2t, log_q(logits))

    def step(frontier: torch.Tensor, tree: DraftTree) -> torch.Tensor:
        if tree.size == 1:
            return to_target(root_logits.view(1, -1))
        begin, visible = rows.block(frontier, tree)
        pos = (base - 2) + tree.depth[frontier]
        g_in = states.index_select(0, tree.parents[frontier])
        logits, out = runner.rows_masked(g_in, tree.tokens[frontier], begin, pos, visible, cache)
        states.index_copy_(0, frontier, out)
        return to_target(logits)

    return step


def can_expand(seq: Any) -> bool:
    """A head needs target features of at least one row (a prompt of one token has none)."""
    return not is_head(seq.draft) or len(seq.tokens) - 1 > seq.dcache.length


def tree_step(target: Any, seq: Any, shape: TreeShape,
              mark: Callable[[], None] = lambda: None) -> tuple[list[int], torch.Tensor, int, int]:
    """Expand, score and verify one tree; compact the target cache (and, for a head, keep its
    target rows). Returns (the draft's tokens for commit: the accepted path plus the best child
    at the first rejected position, the target's logits at the committed positions [n+1, V],
    n accepted, the next token). `mark()` is called after each of expand, score and verify."""
    draft, cache = seq.draft, seq.slot.target
    base = len(seq.tokens)
    head = is_head(draft)
    expander = (_head_expander if head else _layer_expander)(draft, seq, base, shape)
    root = seq.to_device([seq.tokens[-1]])[0]
    params = seq.params.sampling
    gen = None if params.greedy else seq.gen
    tree = expand_tree(expander, root, shape.depth, shape.top_k, shape.total, gen)
    mark()
    mask, pos, _ = tree_attention(tree, base - 1, cache.max_len)
    start = torch.arange(cache.max_len, device=seq.device)[base - 1: base]
    layers = draft.feature_layers if head else ()
    logits, feats = target.forward_masked(tree.tokens, start, pos, mask, cache, layers)
    mark()
    if params.greedy:
        path, nxt = verify_tree_greedy(tree, torch.argmax(logits, dim=-1))
    else:
        path, nxt = verify_tree_sampling(tree, warp_probs(logits, params), gen)
    mark()
    rows = torch.tensor([0] + path, device=seq.device)
    src, dst = compaction_indices(base - 1, path, seq.device)
    compact_kv_(cache.k, cache.v, src, dst)
    cache.length = base + len(path)
    if head:
        seq.step_feats = feats.index_select(0, rows)  # commit() keeps the head's target rows (commit_head)
    else:
        seq.dcache.truncate(base)  # drop expanded nodes; accepted tokens return as pending input
    return _draft_tokens(tree, path), logits.index_select(0, rows), len(path), nxt


def _draft_tokens(tree: DraftTree, path: list[int]) -> list[int]:
    """The accepted path plus the draft's guess at the first rejected position: the best-
    scored child of the last accepted node, if it has one (capture records it)."""
    tokens = tree.tokens.tolist()
    last = path[-1] if path else 0
    children = [i for i, p in enumerate(tree.parents.tolist()) if p == last]
    logp = tree.logp.tolist()
    guess = [tokens[max(children, key=lambda i: logp[i])]] if children else []
    return [tokens[i] for i in path] + guess
