"""One speculative step with a draft tree (EAGLE-2 style), greedy or sampled.

    expand (draft, one block forward per depth: tree_block) -> score (the tree's nodes are one
    item of the step's target forward, beside the other requests' rows, under an ancestor
    mask: serve/engine/step.py) -> verify (tree_verify: walk the target's argmax down the
    tree, or rejection-sample down it) -> commit (compact the accepted path's K/V rows into the prefix)

Slots and positions. With `base` committed tokens the target cache holds base-1 of them and
the root of the tree is the last committed token: tree node i goes to target slot base-1+i
at position base-1+depth(i) (serve/spec_decode/trees/dynamic.py tree_attention). The draft's rows for expanded
nodes go after its committed rows, at slots recorded per node on the device, and are dropped
after the step: the accepted tokens come back as the next step's input, as with chains.

Each draft grows its tree (serve/spec_decode/protocol.py propose_tree); the weighted families expand it the
same way, with expand_tree:
- a layer draft has seen every committed token; node rows are its forward over the node's
  token at position base-1+depth;
- a head draft (serve/spec_decode/head/draft.py) holds target rows up to base-2; a node's row reads the
  state of the row that proposed it (its parent's row; the root's is the catch-up's last row)
  and the node's token, at position base-2+depth. Its vocabulary is the draft vocabulary,
  mapped to target ids (d2t); other tokens get log-prob -inf.

The suffix draft proposes its tree whole from its index, with no draw (q None): greedy walks
it as any tree; sampling verifies it positionally (verify_tree_positional), the target's own
seeded draw at each depth.

Greedy expands EAGLE-2's top-k children. Sampling draws each node's children from the
draft's warped distribution q without replacement (expand_tree with the request's generator)
and verifies with the exact multi-draft rule (serve/spec_decode/trees/dynamic.py verify_tree_sampling): EAGLE-2's
top-k children are not a sample of q, and verifying them by rejection would bias the output.
q and the target's p are warped by the request's temperature, top-k and top-p, as chains do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from infra.config import TreeShape  # serve.tree's shape, checked when the config loads
from serve.spec_decode.trees.dynamic import (DraftTree, ancestor_matrix, compact_kv_, compaction_indices, expand_tree, tree_attention,
                        verify_tree_greedy, verify_tree_positional, verify_tree_sampling)
from serve.sampling.verify import SamplingParams, warp_probs


class NodeRows:
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


def tree_log_q(params: SamplingParams) -> Callable[[torch.Tensor], torch.Tensor]:
    """The draft's log-probabilities the tree is expanded from: plain under greedy (EAGLE-2
    ranks by them), warped like the target's p under sampling (children are drawn from them)."""
    if params.greedy:
        return lambda logits: torch.log_softmax(logits.float(), -1)
    return lambda logits: warp_probs(logits, params).log()


def grow_tree(seq: Any, step: Callable, shape: TreeShape) -> DraftTree:
    """expand_tree from the last committed token (sampled children under sampling)."""
    root = seq.to_device([seq.tokens[-1]])[0]
    gen = None if seq.params.sampling.greedy else seq.gen
    return expand_tree(step, root, shape.depth, shape.top_k, shape.total, gen)


@dataclass
class TreeBlock:
    """A request's tree as one item of the step's target forward: its nodes' tokens, written at
    cache slots base-1+i (base: the request's committed tokens), rotated to positions `pos`,
    each attending where `visible` marks (the prefix and its ancestors)."""
    tree: DraftTree
    pos: torch.Tensor  # [N]
    visible: torch.Tensor  # [N, max_len] bool


def tree_block(seq: Any, shape: TreeShape, ctx: Any) -> TreeBlock:
    """The draft's tree for this step, with the target's mask and positions for scoring it."""
    base = len(seq.tokens)
    tree = seq.draft.propose_tree(seq, shape, ctx)
    mask, pos, _ = tree_attention(tree, base - 1, seq.slot.target.max_len)
    return TreeBlock(tree, pos, mask)


def tree_verify(seq: Any, block: TreeBlock, logits: torch.Tensor,
                feats: torch.Tensor | None) -> tuple[list[int], torch.Tensor, int, int]:
    """The scored tree verified and the target cache compacted to the accepted path. Returns
    (the draft's tokens for commit: the accepted path plus the best child at the first
    rejected position, the target's logits at the committed positions [n+1, V], n accepted,
    the next token); the committed positions' features, where the draft reads them, wait in
    seq.step_feats for commit. Before commit: the request still has the step's base tokens."""
    tree, base, cache = block.tree, len(seq.tokens), seq.slot.target
    params = seq.params.sampling
    if params.greedy:
        path, nxt = verify_tree_greedy(tree, torch.argmax(logits, dim=-1))
    elif tree.q is None:  # chosen, not drawn: the target's seeded draw per position
        path, nxt = verify_tree_positional(tree, warp_probs(logits, params), seq.seed, base)
    else:
        path, nxt = verify_tree_sampling(tree, warp_probs(logits, params), seq.gen)
    rows = torch.tensor([0] + path, device=seq.device)
    src, dst = compaction_indices(base - 1, path, seq.device)
    compact_kv_(cache.k, cache.v, src, dst)
    cache.length = base + len(path)
    if feats is not None:
        seq.step_feats = feats.index_select(0, rows)
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
