"""Serving a `head` draft (infra/drafts/head.py): its runner and its propose stage.

Rows and caches. Row t of the head reads the target's features at position t and the token
x_{t+1}, and predicts x_{t+2}. With N committed tokens the target has features for positions
0..N-2 (the last token is the next forward's input), so the head's cache holds target rows
0..N-2 at most. Per request the head keeps a HeadState (the request's draft state): the target
features of the rows the head has not cached yet (from `feat_start`), taken from the verify
forward and the prefill, which compute them anyway: no extra target work, no host sync.

Propose: one head forward catches up on those rows (target features) and gives draft 1; each
further draft is one row fed with the head's own output state. After verification the head's
cache keeps its target rows only (commit_head); the accepted positions come back as target
rows next step.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from serve.spec_decode.protocol import Draft, Proposal, StepContext, draft_state
from serve.spec_decode.head.lean import LeanHead
from serve.model.factory import say_once
from serve.model.runner import StaticKVCache
from serve.spec_decode.trees.dynamic import DraftTree
from serve.spec_decode.trees.stages import NodeRows, TreeShape, grow_tree, tree_log_q
from serve.sampling.verify import warp_probs


# The head's own weights beside a target of the given weight format. Not int4 beside an int4
# target: 4-bit codes of a one-layer head move its greedy draft off the float head's and lower
# its acceptance (docs/benchmarks.md, "The head's weights").
HEAD_QUANT = {"none": "none", "int4": "int8"}
# "off": heads draft through PyTorch (LeanHead) even beside a native int4 target.
NATIVE_HEAD_ENV = "OSD_NATIVE_HEAD"



def head_kernel(head: Any, quant: str, cpu_kernels: str = "auto") -> Any:
    """What runs a head's eager rows: the native kernels (serve/spec_decode/head/native.py) for a
    head beside an int4 target on the CPU, unless `cpu_kernels` is "torch" or OSD_NATIVE_HEAD is
    "off"; else LeanHead. With "auto" a head the native kernels cannot run falls back to
    LeanHead, saying why once; "native" refuses it."""
    if (quant == "int4" and head.d2t.device.type == "cpu" and cpu_kernels != "torch"
            and os.environ.get(NATIVE_HEAD_ENV, "on") != "off"):
        from serve.model.native_build import NativeUnavailable
        from serve.spec_decode.head.native import NativeHead

        try:
            return NativeHead(head)
        except NativeUnavailable as e:
            if cpu_kernels == "native":
                raise ValueError(str(e)) from None
            say_once(f"{e}; the head drafts through PyTorch")
    return LeanHead(head, HEAD_QUANT[quant])


@contextlib.contextmanager
def torch_head_kernels() -> Iterator[None]:
    """Heads built inside draft through PyTorch (osd bench engine --vs-torch-head)."""
    before = os.environ.get(NATIVE_HEAD_ENV)
    os.environ[NATIVE_HEAD_ENV] = "off"
    try:
        yield
    finally:
        if before is None:
            del os.environ[NATIVE_HEAD_ENV]
        else:
            os.environ[NATIVE_HEAD_ENV] = before


@dataclass
class HeadState:
    """A request's head state: target features of the rows its cache lacks, from feat_start.

    A step's rows are appended as a piece and joined only when read: while the head does not
    draft (the suffix draft takes the steps, or a batch's gate holds drafting back) its backlog
    grows by every committed row, and joining it at every commit copied the whole backlog each
    step, quadratic in the answer's length."""
    pieces: list[torch.Tensor] = field(default_factory=list)
    feat_start: int = 0

    @property
    def feats(self) -> torch.Tensor | None:
        """The backlog as one tensor (None before any row came)."""
        if not self.pieces:
            return None
        if len(self.pieces) > 1:
            self.pieces = [torch.cat(self.pieces)]
        return self.pieces[0]

    @feats.setter
    def feats(self, value: torch.Tensor | None) -> None:
        self.pieces = [] if value is None else [value]

    def append(self, rows: torch.Tensor) -> None:
        # A copy: a step's rows are a view of the step's whole feature output (every request's
        # rows and prompt chunks), which a kept view would hold for as long as the backlog.
        self.pieces.append(rows.clone())

    def drop_before(self, row: int) -> None:
        """Forget the rows before `row` (the head's cache holds them now)."""
        if row > self.feat_start and self.pieces:
            self.feats = self.feats[row - self.feat_start:]
        self.feat_start = row


def head_state(seq: Any) -> HeadState:
    return draft_state(seq, HeadRunner.family, HeadState)

class HeadRunner(Draft):
    """A head draft: its runner (rows over target features) and the Draft protocol."""

    family = "head"

    def __init__(self, head: Any, max_seq_len: int | None = None, quant: str = "none", cpu_kernels: str = "auto"):
        self.head = head
        # Eager rows and the fuse: native beside an int4 target on the CPU, else fused PyTorch weights.
        self.kernel = head_kernel(head, quant, cpu_kernels)
        self.device = head.d2t.device
        self.dtype = head.embed.dtype
        self.vocab_size = head.vocab_size
        self.feature_layers: tuple[int, ...] = head.feature_layers
        limit = head.cos.shape[0]
        self.max_seq_len = min(max_seq_len or limit, limit)
        self.causal = torch.ones(self.max_seq_len, self.max_seq_len, dtype=torch.bool, device=self.device).tril()
        self.arange = torch.arange(self.max_seq_len, device=self.device)
        self.graphs = None  # a serve.graphs.GraphSet once enable_graphs() is called (CUDA)
        self.max_graph_tokens = 0

    def enable_graphs(self, max_tokens: int) -> None:
        """Replay row blocks of up to max_tokens (draft steps, catch-up after verify) as CUDA graphs."""
        from serve.model.cuda_graphs import GraphSet

        self.graphs = GraphSet(self.new_cache)
        self.max_graph_tokens = max_tokens

    def new_cache(self) -> StaticKVCache:
        h = self.head
        return StaticKVCache(1, h.n_kv, self.max_seq_len, h.head_dim, self.dtype, self.device)

    @property
    def cache_key(self) -> tuple:
        h = self.head
        return ("head", h.n_kv, self.max_seq_len, h.head_dim, self.dtype, str(self.device))

    def forward(self, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
        raise TypeError("a head draft reads target features: the engine drives it through propose_head")

    @torch.inference_mode()
    def rows(self, g: torch.Tensor, next_ids: torch.Tensor, cache: StaticKVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Append rows (inputs g [T, h], next tokens [T]) to the cache. Returns the last row's
        draft-vocab logits [V_d] and its output state [1, h]."""
        t, start = next_ids.shape[0], cache.length
        end = start + t
        if end > cache.max_len:
            raise ValueError(f"sequence of {end} rows exceeds the head cache's {cache.max_len}")
        if self.graphs is not None and t <= self.max_graph_tokens:
            logits, state = self.graphs.run((id(cache), t), self.rows_static, cache,
                                            (g, next_ids, self.arange[start:start + 1]))
            cache.length = end
            return logits.clone(), state.clone()
        mask = None if t == 1 else self.causal[start:end, :end]
        logits, state = self.kernel.rows(g, next_ids, cache, start, mask)
        cache.length = end
        return logits, state

    @torch.inference_mode()
    def rows_batch(self, gs: list[torch.Tensor], nexts: list[torch.Tensor],
                   caches: list[StaticKVCache]) -> tuple[torch.Tensor, torch.Tensor]:
        """rows() for several sequences in one head forward: (last-row logits [B, V_d], states [B, h])."""
        masks = []
        for n, c in zip(nexts, caches):
            start, end = c.length, c.length + n.shape[0]
            if end > c.max_len:
                raise ValueError(f"sequence of {end} rows exceeds the head cache's {c.max_len}")
            masks.append(None if n.shape[0] == 1 else self.causal[start:end, :end])
        logits, states = self.kernel.rows_batch(gs, nexts, caches, masks)
        for n, c in zip(nexts, caches):
            c.length += n.shape[0]
        return logits, states

    @torch.inference_mode()
    def rows_static(self, cache: StaticKVCache, g: torch.Tensor, next_ids: torch.Tensor,
                    start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows() with shapes fixed by T alone (start a [1] tensor; full-cache attention under
        a mask), for CUDA graphs; leaves cache.length to the caller."""
        slots = start + self.arange[: next_ids.shape[0]]
        visible = self.arange.unsqueeze(0) <= slots.unsqueeze(1)
        logits, states = self._rows_at(cache, g, next_ids, slots, slots, visible, last_only=True)
        return logits[-1], states

    @torch.inference_mode()
    def rows_masked(self, g: torch.Tensor, next_ids: torch.Tensor, start: torch.Tensor, pos: torch.Tensor,
                    visible: torch.Tensor, cache: StaticKVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows that are not a chain (draft-tree nodes): row i at cache slot start+i, position
        pos[i], attending to the rows visible[i] marks. Returns every row's draft-vocab logits
        [T, V_d] and output states [T, h]; leaves cache.length to the caller."""
        t = next_ids.shape[0]
        if self.graphs is not None and t <= self.max_graph_tokens:
            def block(c, g_, ids, at, p, vis):
                return self._rows_at(c, g_, ids, at + self.arange[:t], p, vis, last_only=False)

            logits, states = self.graphs.run((id(cache), t, "masked"), block, cache,
                                             (g, next_ids, start, pos, visible))
            return logits.clone(), states.clone()
        return self._rows_at(cache, g, next_ids, start + self.arange[:t], pos, visible, last_only=False)

    def _rows_at(self, cache: StaticKVCache, g: torch.Tensor, next_ids: torch.Tensor, slots: torch.Tensor,
                 pos: torch.Tensor, visible: torch.Tensor, last_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.head
        x = h.mix(g.unsqueeze(0), next_ids.unsqueeze(0))
        q, k, v = h.qkv(x, pos)
        cache.k[0].index_copy_(1, slots, k[0])
        cache.v[0].index_copy_(1, slots, v[0])
        o = h.attend(x, q, cache.k, cache.v, visible)[0]
        if last_only:
            return h.logits(o[-1:]), o[-1:]
        return h.logits(o), o

    @torch.inference_mode()
    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        return self.kernel.fuse(feats)


    # -- the Draft protocol (serve/spec_decode/protocol.py) ------------------------------------

    def prefilled(self, seq: Any, feats: torch.Tensor | None) -> None:
        head_state(seq).feats = feats  # rows from feat_start: 0, or where a taken prefix ends
        prefill_head(self, seq)

    def prefix_taken(self, seq: Any, n: int) -> None:
        head_state(seq).feat_start = n

    def propose(self, seqs: list[Any], ks: list[int], ctx: StepContext) -> list[Proposal]:
        return [Proposal(t, q, own, self.family) for t, q, own in propose_heads(self, seqs, ks, ctx.confidence)]

    def can_tree(self, seq: Any) -> bool:
        """Target features of at least one row are needed (a one-token prompt has none)."""
        return len(seq.tokens) - 1 > seq.dcache.length

    def propose_tree(self, seq: Any, shape: TreeShape, ctx: StepContext) -> DraftTree:
        return grow_tree(seq, self._expander(seq, len(seq.tokens), shape), shape)

    def _expander(self, seq: Any, base: int, shape: TreeShape) -> Callable:
        """A node's row reads the state of the row that proposed it (its parent's; the root's
        is the catch-up's last row) and the node's token, at position base-2+depth; the draft
        vocabulary maps to target ids (d2t), other tokens get log-prob -inf."""
        cache, d2t = seq.dcache, self.head.d2t
        start = cache.length
        st = head_state(seq)
        g = self.fuse(st.feats[start - st.feat_start:])
        root_logits, root_state = self.rows(g, seq.to_device(seq.tokens[start + 1:]), cache)
        states = root_state.new_zeros(shape.max_candidates, root_state.shape[-1])
        states[0] = root_state[0]
        rows = NodeRows(cache, cache.length, shape, seq.device)
        log_q = tree_log_q(seq.params.sampling)

        def to_target(logits: torch.Tensor) -> torch.Tensor:
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"), dtype=torch.float32)
            return full.index_copy_(1, d2t, log_q(logits))

        def step(frontier: torch.Tensor, tree: DraftTree) -> torch.Tensor:
            if tree.size == 1:
                return to_target(root_logits.view(1, -1))
            begin, visible = rows.block(frontier, tree)
            pos = (base - 2) + tree.depth[frontier]
            g_in = states.index_select(0, tree.parents[frontier])
            logits, out = self.rows_masked(g_in, tree.tokens[frontier], begin, pos, visible, cache)
            states.index_copy_(0, frontier, out)
            return to_target(logits)

        return step

    def commit(self, seq: Any, base: int, n: int, drafted: int, feats: torch.Tensor | None) -> None:
        commit_head(seq, base, feats)

    def reserve_graph_tokens(self, n: int) -> None:
        if self.graphs is not None:
            self.max_graph_tokens = max(self.max_graph_tokens, n)


def prefill_head(runner: HeadRunner, seq: Any) -> None:
    """At prefill: the head's rows over the prompt's target features, all but the last (rows
    0..N-3 of N prompt tokens; row t reads position t's features and token t+1), so the first
    propose runs one row as every later one does. Rows before feat_start came with a prompt
    prefix taken from a slot (prefix_taken). Moves the request's HeadState past them."""
    n = len(seq.tokens) - 2
    st = head_state(seq)
    start = st.feat_start
    if st.feats is None or n <= start:
        return
    nxt = torch.tensor(seq.tokens[start + 1:n + 1], dtype=torch.long, device=seq.device)
    runner.rows(runner.fuse(st.feats[:n - start]), nxt, seq.dcache)
    st.feats, st.feat_start = st.feats[n - start:], n


def propose_heads(runner: HeadRunner, seqs: list[Any], ks: list[int], confidence: float) -> list[tuple]:
    """propose_head for several requests with one head forward per draft position (batched
    drafting): the same proposals each would make alone, to the rounding of the batched rows."""
    empty = (torch.empty(0, dtype=torch.long, device=runner.device), None, [])
    out: list[tuple] = [empty] * len(seqs)
    d2t = runner.head.d2t
    live, g, nxt = [], {}, {}
    for i, (seq, k) in enumerate(zip(seqs, ks)):
        start = seq.dcache.length
        if k <= 0 or len(seq.tokens) - 1 <= start:  # nothing to draft, or no target features yet
            continue
        live.append(i)
        st = head_state(seq)
        g[i] = runner.fuse(st.feats[start - st.feat_start:])
        nxt[i] = torch.tensor(seq.tokens[start + 1:], dtype=torch.long, device=seq.device)
    tokens: dict[int, list[int]] = {i: [] for i in live}
    qs: dict[int, list[torch.Tensor]] = {i: [] for i in live}
    own: dict[int, list[float]] = {i: [] for i in live}
    for pos in range(max(ks, default=0)):
        live = [i for i in live if pos < ks[i]]
        if not live:
            break
        logits, states = runner.rows_batch([g[i] for i in live], [nxt[i] for i in live],
                                           [seqs[i].dcache for i in live])
        going = []
        for row, i in enumerate(live):
            params = seqs[i].params.sampling
            lg = seqs[i].draft_logits(logits[row], tokens[i], d2t)  # the request's processors, as the target's
            probs = torch.softmax(lg, dim=-1) if params.greedy else warp_probs(lg, params)
            if pos > 0 and float(probs.max()) < confidence:  # decided before drawing, as propose()
                continue
            j = int(torch.argmax(probs)) if params.greedy else int(torch.multinomial(probs, 1, generator=seqs[i].gen))
            tok = int(d2t[j])
            tokens[i].append(tok)
            own[i].append(float(probs[j]))
            if not params.greedy:
                qs[i].append(torch.zeros(runner.vocab_size, dtype=probs.dtype, device=probs.device
                                         ).index_copy_(0, d2t, probs))
            g[i], nxt[i] = states[row:row + 1], torch.tensor([tok], dtype=torch.long, device=seqs[i].device)
            going.append(i)
        live = going
    for i in tokens:
        out[i] = (torch.tensor(tokens[i], dtype=torch.long, device=runner.device),
                  torch.stack(qs[i]) if qs[i] else None, own[i])
    return out


def commit_head(seq: Any, base: int, feats: torch.Tensor) -> None:
    """After verify: keep the head's target rows only (rows <= base-2, base = committed tokens
    before this step) and add the target features of this step's committed positions (`feats`,
    rows base-1..), dropping features of rows the cache already holds."""
    cache = seq.dcache
    cache.truncate(min(cache.length, base - 1))
    st = head_state(seq)
    st.append(feats)  # no rows yet: a one-token prompt had no prefill
    st.drop_before(cache.length)
