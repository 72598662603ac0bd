"""One engine step over the scheduler's plan (serve/engine/scheduler.py): the one decode
step, for chains and draft trees alike, on the CPU and on a GPU.

    lengths        -> propose               -> execute               -> verify, commit, deliver
    the one policy    chains: Draft.propose    one target forward      per request: a chain by
    (SpecEngine.plan) (a family's requests     over every row: each    its sampling rule, a tree
    asked once for    together); trees:        chain's pending token   down the tree (then its
    the step          Draft.propose_tree       and drafts, each tree's K/V compacted); prompt
                      (serve/spec_decode/      nodes under their mask, chunks finish their
                      trees/stages.py)         the prompt chunks       prefill
                                               (serve/model/batch_forward.py)

A request decoding alone takes the same step as a batch of one. Stage times are host clocks
around each stage; on a GPU the step waits for its forward before verify, so the score stage
(and the forward cost the draft-length policy learns) is the forward's own time.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

from infra.records.tokens import topk_logprobs
from serve.engine.scheduler import StepPlan, StepTook
from serve.engine.sequence import Seq
from serve.engine.stages import commit, end_prefill, prefilled_chunk, verify
from serve.model import native_logits
from serve.model.batch_forward import Item, Output, forward_batch
from serve.sampling.verify import verify_greedy
from serve.spec_decode.protocol import Proposal, no_proposal, shared_seconds
from serve.spec_decode.trees.stages import TreeBlock, tree_block, tree_verify


class SpecEngine(Protocol):
    """What the step reads of the engine (serve/engine/core.py SpecEngine)."""
    target: Any
    device: torch.device
    gpu: bool
    tree: Any  # its TreeShape, or None

    def begin_step(self) -> None: ...
    def use_tree(self, seq: Seq) -> bool: ...
    def plan(self, seqs: list[Seq], prefill_rows: int = 0) -> list[int]: ...
    def step_context(self, seqs: list[Seq], ks: list[int]) -> Any: ...
    def observe_forward(self, sequences: int, rows: int, seconds: float) -> None: ...


def run_step(eng: SpecEngine, plan: StepPlan) -> StepTook:
    """Run one step's plan: every decoding request's proposal and the prompt chunks in one
    target forward, then each request's verify and commit."""
    t_step = time.perf_counter()
    before = sum(len(s.out) for s in plan.decode)
    take_prefixes(plan.prefixes)
    eng.begin_step()
    as_tree = [eng.use_tree(s) for s in plan.decode]
    trees = [s for s, t in zip(plan.decode, as_tree) if t]
    chains = [s for s, t in zip(plan.decode, as_tree) if not t]
    prompt_rows = sum(t.numel() for _, t in plan.chunks)
    ks = eng.plan(chains, prompt_rows)
    props = propose_all(eng, chains, ks)
    blocks = [_propose_tree(eng, s) for s in trees]
    items = [Item(torch.cat([s.pending(s.slot.target), p.tokens]), s.slot.target) for s, (p, _) in zip(chains, props)]
    items += [Item(b.tree.tokens, s.slot.target, pos=b.pos, visible=b.visible) for s, (b, _) in zip(trees, blocks)]
    items += [Item(toks, s.slot.target, logits=False) for s, toks in plan.chunks]
    layers = _feature_layers(plan.decode + [s for s, _ in plan.chunks])
    t1 = time.perf_counter()
    outs = forward_batch(eng.target, items, layers, pool=eng.gpu)
    if eng.device.type == "cuda":  # the forward's own time, for the policy; verify's read would wait for it anyway
        torch.cuda.synchronize(eng.device)
    score_s = time.perf_counter() - t1
    rows = sum(it.tokens.numel() for it in items)
    n_chain, n_tree = len(chains), len(trees)
    _finish_chains(eng, chains, props, outs[:n_chain], layers, rows, score_s)
    _finish_trees(trees, blocks, outs[n_chain:n_chain + n_tree], layers, rows, score_s)
    for (seq, toks), (_, feats) in zip(plan.chunks, outs[n_chain + n_tree:]):
        prefilled_chunk(seq, toks.numel(), _pick(feats, layers, _reads(seq)))
        if not seq.prefilling:
            end_prefill(seq)
            seq.t_decode = time.perf_counter()
    if plan.decode:
        eng.observe_forward(len(items), rows, score_s)
    emitted = sum(len(s.out) for s in plan.decode) - before
    return StepTook(len(items), rows, time.perf_counter() - t_step, emitted, prompt_rows)


def take_prefixes(prefixes: list[tuple[Seq, Any, int]]) -> None:
    """The prompt prefixes the plan gave new requests, into their caches before any forward of
    the step writes a slot (serve/engine/prefix.py); a prompt that a prefix covers up to its
    last token has ended its prefill."""
    for seq, source, n in prefixes:
        seq.slot.target.take_prefix(source.target, n)
        if seq.reads_features:  # its cache's rows over the prefix (the scheduler checked they are its own)
            seq.dcache.take_prefix(source.drafts[seq.draft.cache_key], n)
            seq.draft.prefix_taken(seq, n)
        if not seq.prefilling:
            end_prefill(seq)
            seq.t_decode = time.perf_counter()


def propose_all(eng: SpecEngine, seqs: list[Seq], ks: list[int]) -> list[tuple[Proposal, float]]:
    """The chains' propose stage: the requests of each draft propose together (a head drafts
    them in one forward per draft position); the call's time is shared out by the tokens
    each request got, unless the draft timed its proposals itself (Proposal.seconds). Per
    request (its proposal, seconds)."""
    ctx = eng.step_context(seqs, ks)
    out: list[tuple[Proposal, float]] = [(no_proposal(eng.device), 0.0)] * len(seqs)
    groups: dict[int, list[int]] = {}
    for i, seq in enumerate(seqs):
        if seq.draft is not None:
            groups.setdefault(id(seq.draft), []).append(i)
    for members in groups.values():
        t0 = time.perf_counter()
        got = seqs[members[0]].draft.propose([seqs[i] for i in members], [ks[i] for i in members], ctx)
        took = time.perf_counter() - t0
        for i, p, share in zip(members, got, shared_seconds(took, [p.tokens.numel() for p in got])):
            seqs[i].step_source = p.source
            out[i] = (p, share if p.seconds is None else p.seconds)
    return out


def _propose_tree(eng: SpecEngine, seq: Seq) -> tuple[TreeBlock, float]:
    t0 = time.perf_counter()
    block = tree_block(seq, eng.tree, eng.step_context([seq], [eng.tree.total - 1]))
    return block, time.perf_counter() - t0


def _finish_chains(eng: SpecEngine, chains: list[Seq], props: list[tuple[Proposal, float]], outs: list[Output],
                   layers: tuple[int, ...], rows: int, score_s: float) -> None:
    logits = [lg for lg, _ in outs]
    stats = None if eng.gpu else _row_stats(chains, logits)
    topks = _capture_topk(chains, logits, stats)
    reads = _greedy_reads(chains, [p.tokens for p, _ in props], logits, eng.gpu, stats)
    for seq, (p, draft_s), (lg, feats), topk, read in zip(chains, props, outs, topks, reads):
        seq.step_feats = _pick(feats, layers, _reads(seq))
        t3 = time.perf_counter()
        if read is not None:
            n, nxt = verify_greedy(*read)
            drafted = read[0].tolist()
        else:
            n, nxt = verify(seq, p.tokens, p.q, lg, p.point_mass)
            drafted = p.tokens.tolist()
        t4 = time.perf_counter()
        emitted = commit(seq, drafted, p.own, lg, n, nxt, topk)
        t5 = time.perf_counter()
        _clock(seq, rows, draft_s, score_s, t4 - t3, t5 - t4)
        _learn(seq, p.tokens.numel(), n, draft_s, t5 - t3)  # the policy's verify cost: verify and commit
        seq.deliver(emitted)


def _finish_trees(trees: list[Seq], blocks: list[tuple[TreeBlock, float]], outs: list[Output],
                  layers: tuple[int, ...], rows: int, score_s: float) -> None:
    for seq, (block, draft_s), (lg, feats) in zip(trees, blocks, outs):
        t3 = time.perf_counter()
        drafts, kept, n, nxt = tree_verify(seq, block, lg, _pick(feats, layers, _reads(seq)))
        own = [float("nan")] * len(drafts)  # a tree has no single proposal probability per position
        t4 = time.perf_counter()
        emitted = commit(seq, drafts, own, kept, n, nxt)
        _clock(seq, rows, draft_s, score_s, t4 - t3, time.perf_counter() - t4)
        seq.deliver(emitted)


def _clock(seq: Seq, rows: int, draft_s: float, score_s: float, verify_s: float, commit_s: float) -> None:
    clock = seq.stats.stage_s
    clock["propose"] += draft_s
    clock["score"] += score_s
    clock["verify"] += verify_s
    clock["commit"] += commit_s
    by_t = seq.stats.score_by_tokens.setdefault(rows, [0, 0.0])
    by_t[0] += 1
    by_t[1] += score_s


def _learn(seq: Seq, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
    """What the draft-length policy learns of a chain's step (its forward's cost is observed
    once per step, SpecEngine.observe_forward), and the per-source figures."""
    seq.stats.count_source(seq.step_source, drafted, accepted)
    if seq.length is not None:
        learn = seq.draft.teaches_k(seq.step_source)
        seq.length.observe_costs(drafted, draft_s, verify_s, learn)
        if learn:
            seq.length.observe(drafted, accepted)


RowStats = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # argmax [t], top-k ids [t, k], log-probs [t, k]


def _row_stats(batch: list[Seq], logits: list[torch.Tensor]) -> list[RowStats] | None:
    """On the CPU, each request's argmax and capture top-k over its logit rows, from one native
    call for the step (serve/model/native_logits.py); None where it does not run, and then
    PyTorch reads them as before. The top-k is the one top_k every capturing request asks for
    (empty where they differ: each then computes its own)."""
    if not batch or not native_logits.available():
        return None
    ks = {s.capture.top_k for s in batch if s.capture is not None}
    got = native_logits.logit_stats(_joined(logits), ks.pop() if len(ks) == 1 else 0)
    if got is None:
        return None
    out: list[RowStats] = []
    lo = 0
    for lg in logits:
        t = lg.shape[0]
        out.append((got[0][lo:lo + t], got[1][lo:lo + t], got[2][lo:lo + t]))
        lo += t
    return out


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The rows of `parts` as one [rows, V] tensor: a view where they lie back to back in one
    buffer (a batched forward's logits, item after item), else a copy."""
    first = parts[0]
    at, base = first.data_ptr(), first.untyped_storage().data_ptr()
    for p in parts:
        if not p.is_contiguous() or p.data_ptr() != at or p.untyped_storage().data_ptr() != base:
            return torch.cat(parts)
        at += p.numel() * p.element_size()
    return first.as_strided((sum(p.shape[0] for p in parts), first.shape[1]), (first.shape[1], 1))


def _capture_topk(batch: list[Seq], logits: list[torch.Tensor],
                  stats: list[RowStats] | None = None) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Each capturing request's top-k (ids, log-probs) over its logit rows: from the step's
    native row stats where they hold it (one top_k for all), else computed for the whole step in one call when
    several capture with one top_k (one topk and one logsumexp over [rows, V] instead of one
    pair per request); None where a request computes its own."""
    want = [i for i, s in enumerate(batch) if s.capture is not None]
    ks = {batch[i].capture.top_k for i in want}
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(batch)
    if stats is not None and len(ks) == 1:
        for i in want:
            out[i] = (stats[i][1], stats[i][2])
        return out
    if len(want) < 2 or len(ks) != 1:
        return out
    ids, lps = topk_logprobs(torch.cat([logits[i] for i in want]), ks.pop())
    lo = 0
    for i in want:
        t = logits[i].shape[0]
        out[i], lo = (ids[lo:lo + t], lps[lo:lo + t]), lo + t
    return out


def _greedy_reads(batch: list[Seq], drafts: list[torch.Tensor], logits: list[torch.Tensor], device: bool,
                  stats: list[RowStats] | None = None) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """What greedy verify reads of every greedy request without processors, (drafts, the
    target's argmax per row) on the host: on a GPU in one device-to-host copy for the whole
    step instead of a few syncs per request, on the CPU from the step's native row stats; None
    for the others, which verify as a request alone does."""
    plain = [i for i, s in enumerate(batch) if s.params.sampling.greedy and s.proc is None]
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(batch)
    if not device:
        if stats is not None:
            for i in plain:
                out[i] = (drafts[i], stats[i][0])
        return out
    if not plain:
        return out
    parts = [t for i in plain for t in (drafts[i], logits[i].argmax(-1))]
    host = torch.cat(parts).cpu().split([t.numel() for t in parts])
    for j, i in enumerate(plain):
        out[i] = (host[2 * j], host[2 * j + 1])
    return out


def _reads(seq: Seq) -> tuple[int, ...]:
    """The target layers the request's draft reads features of (none for most drafts)."""
    return seq.draft.feature_layers if seq.draft is not None else ()


def _feature_layers(seqs: list[Seq]) -> tuple[int, ...]:
    """Every layer a draft in the step reads (drafts of one family read the same)."""
    return tuple(sorted({i for s in seqs for i in _reads(s)}))


def _pick(feats: torch.Tensor | None, have: tuple[int, ...], want: tuple[int, ...]) -> torch.Tensor | None:
    """The columns of `want` layers out of features of `have` layers, concatenated."""
    if feats is None or not want:
        return None
    if have == want:
        return feats
    width = feats.shape[-1] // len(have)
    return torch.cat([feats[:, have.index(i) * width:(have.index(i) + 1) * width] for i in want], dim=-1)
