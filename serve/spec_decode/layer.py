"""A draft that is a causal LM of its own (truncated target layers, `self`, any Hugging Face
model sharing the vocabulary): the Draft protocol (serve/spec_decode/protocol.py) over its runner.

Its cache holds the committed tokens it has seen: each proposal first feeds it the committed
tokens it lacks (one after a partial acceptance; two after a full one, or more after steps the
cost rule drafted nothing), so a request that never drafts never pays for its prompt.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from serve.spec_decode.protocol import Draft, Proposal, StepContext, no_proposal
from serve.spec_decode.trees.dynamic import DraftTree
from serve.spec_decode.trees.stages import NodeRows, TreeShape, grow_tree, tree_log_q
from serve.sampling.verify import warp_probs


class LayerDraft(Draft):
    family = "layer"

    def __init__(self, runner: Any):
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.max_seq_len = runner.max_seq_len
        self.device = runner.device

    def new_cache(self) -> Any:
        return self.runner.new_cache()

    @property
    def cache_key(self) -> tuple:
        return self.runner.cache_key

    def reserve_graph_tokens(self, n: int) -> None:
        if hasattr(self.runner, "max_graph_tokens"):  # the CUDA-graph runner
            self.runner.max_graph_tokens = max(self.runner.max_graph_tokens, n)

    def propose(self, seqs: list[Any], ks: list[int], ctx: StepContext) -> list[Proposal]:
        return [self._chain(seq, k, ctx.confidence) for seq, k in zip(seqs, ks)]

    def _chain(self, seq: Any, k: int, confidence: float) -> Proposal:
        if k <= 0:
            return no_proposal(seq.device, self.family)
        params = seq.params.sampling
        cache = seq.dcache
        inp = seq.pending(cache)
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        own: list[float] = []
        if inp.numel() > 1:
            # Tokens committed while the draft sat out (the cost rule's k = 0, a full acceptance):
            # into its cache without an output projection over every one of them.
            self.runner.prefill(inp[:-1], cache)
            inp = inp[-1:]
        for i in range(k):
            logits = seq.draft_logits(self.runner.forward(inp, cache)[-1], tokens)
            probs = torch.softmax(logits, dim=-1) if params.greedy else warp_probs(logits, params)
            # The first proposal is always made; later ones only while the draft is confident.
            # Decided on the draft's top probability *before* drawing: stopping on the drawn
            # token's own probability biases kept drafts away from q (sampling turns lossy).
            if i > 0 and float(probs.max()) < confidence:
                break  # the cache keeps the proposals fed so far; commit trims what is rejected
            tok = int(torch.argmax(probs)) if params.greedy else int(torch.multinomial(probs, 1, generator=seq.gen))
            tokens.append(tok)
            own.append(float(probs[tok]))
            if not params.greedy:
                qs.append(probs)
            inp = torch.tensor([tok], dtype=torch.long, device=seq.device)
        drafts = torch.tensor(tokens, dtype=torch.long, device=seq.device)
        return Proposal(drafts, torch.stack(qs) if qs else None, own, self.family)

    def can_tree(self, seq: Any) -> bool:
        return hasattr(self.runner, "forward_masked")

    def propose_tree(self, seq: Any, shape: TreeShape, ctx: StepContext) -> DraftTree:
        base = len(seq.tokens)
        tree = grow_tree(seq, self._expander(seq, base, shape), shape)
        seq.dcache.truncate(base)  # the nodes' rows served the expansion; accepted tokens return as input
        return tree

    def _expander(self, seq: Any, base: int, shape: TreeShape) -> Callable:
        """Node rows are the draft's forward over the node's token at position base-1+depth."""
        cache = seq.dcache
        log_q = tree_log_q(seq.params.sampling)
        root_logp = log_q(self.runner.forward(seq.pending(cache), cache)[-1])
        rows = NodeRows(cache, base, shape, seq.device)

        def step(frontier: torch.Tensor, tree: DraftTree) -> torch.Tensor:
            if tree.size == 1:  # the root's children: the catch-up forward gave them
                return root_logp.unsqueeze(0)
            start, visible = rows.block(frontier, tree)
            pos = (base - 1) + tree.depth[frontier]
            logits, _ = self.runner.forward_masked(tree.tokens[frontier], start, pos, visible, cache)
            return log_q(logits)

        return step

    def commit(self, seq: Any, base: int, n: int, drafted: int, feats: torch.Tensor | None) -> None:
        if seq.dcache is not None and drafted:
            seq.dcache.truncate(min(seq.dcache.length, base + n))
