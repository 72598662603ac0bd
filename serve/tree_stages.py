"""One speculative step with a draft tree (EAGLE-2 style), for a layer draft under greedy decoding.

    expand (draft, one block forward per depth) -> score (target, one forward over the whole
    tree under an ancestor mask) -> verify (walk the target's argmax down the tree) ->
    commit (compact the accepted path's K/V rows into the prefix)

Slots and positions. With `base` committed tokens the target cache holds base-1 of them and
the root of the tree is the last committed token: tree node i goes to target slot base-1+i
at position base-1+depth(i) (serve/tree.py tree_attention). The draft has seen every
committed token (its cache holds base rows after catch-up); the nodes it expands go after
them, at slots recorded per node, and are dropped after the step: the accepted tokens come
back as the next step's pending input, as with chains.

Sampling falls back to chains in the engine: the exact multi-draft rule
(serve/tree.py verify_tree_sampling) needs children drawn from q, which EAGLE-2's top-k
expansion does not do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from serve.tree import DraftTree, compact_kv_, compaction_indices, expand_tree, tree_attention, verify_tree_greedy


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


def _expander(draft: Any, seq: Any, base: int, root_logits: torch.Tensor):
    """step_fn for expand_tree: log-probs of each frontier node's children. Frontier nodes
    are run through the draft as one block, each seeing the committed prefix and its own
    expanded ancestors."""
    cache = seq.dcache
    slot_of: dict[int, int] = {}
    cols = torch.arange(cache.max_len, device=seq.device)

    def step(frontier: torch.Tensor, tree: DraftTree) -> torch.Tensor:
        if tree.size == 1:  # the root's children: the catch-up forward already gave them
            return torch.log_softmax(root_logits.float(), -1).unsqueeze(0)
        start = cache.length
        nodes = frontier.tolist()
        parents = tree.parents.tolist()
        visible = (cols < base).unsqueeze(0).repeat(len(nodes), 1)
        for j, node in enumerate(nodes):
            slot_of[node] = start + j
            a = node
            while a > 0:  # the node itself and its expanded ancestors (the root is in the prefix)
                visible[j, slot_of[a]] = True
                a = parents[a]
        pos = (base - 1) + tree.depth[frontier]
        logits, _ = draft.forward_masked(tree.tokens[frontier], cols[start:start + 1], pos, visible, cache)
        cache.length = start + len(nodes)
        return torch.log_softmax(logits.float(), -1)

    return step


def tree_step(target: Any, seq: Any, shape: TreeShape,
              mark: Callable[[], None] = lambda: None) -> tuple[list[int], torch.Tensor, int, int]:
    """Expand, score and verify one tree; compact the target cache. Returns (the draft's
    tokens for commit: the accepted path plus the best child at the first rejected position,
    the target's logits at the committed positions [n+1, V], n accepted, the next token).
    `mark()` is called after each of expand, score and verify (the engine's stage clock)."""
    draft, cache, dcache = seq.draft, seq.slot.target, seq.dcache
    base = len(seq.tokens)
    root_logits = draft.forward(seq.pending(dcache), dcache)[-1]
    root = seq.to_device([seq.tokens[-1]])[0]
    tree = expand_tree(_expander(draft, seq, base, root_logits), root, shape.depth, shape.top_k, shape.total)
    mark()
    mask, pos, _ = tree_attention(tree, base - 1, cache.max_len)
    dev = seq.device
    start = torch.arange(cache.max_len, device=dev)[base - 1: base]
    logits, _ = target.forward_masked(tree.tokens, start, pos, mask, cache)
    mark()
    path, nxt = verify_tree_greedy(tree, torch.argmax(logits, dim=-1))
    mark()
    src, dst = compaction_indices(base - 1, path, dev)
    compact_kv_(cache.k, cache.v, src, dst)
    cache.length = base + len(path)
    dcache.truncate(base)  # drop expanded nodes; accepted tokens return as pending input
    tokens = tree.tokens.tolist()
    accepted = [tokens[i] for i in path]
    # The draft's guess at the first rejected position: the best-scored child there (if any).
    last = path[-1] if path else 0
    children = [i for i, p in enumerate(tree.parents.tolist()) if p == last]
    guess = [tokens[max(children, key=lambda i: float(tree.logp[i]))]] if children else []
    rows = torch.tensor([0] + path, device=dev)
    return accepted + guess, logits.index_select(0, rows), len(path), nxt
