"""Training the head draft (infra/drafts/head.py): features from the target, the unrolled loss.

Records carry no hidden states (2.3-9.2 KB per position would multiply their size tenfold).
The trainer recomputes them: one no-grad target forward over prompt + output gives every
position's layer features, prompt positions included, and the final hidden state from which
the target's distribution is rebuilt exactly (its own head), over the draft vocabulary.

Rows and targets. Row t of a sequence x_0..x_{L-1} reads features f_t and token x_{t+1} and
predicts x_{t+2}: its target is the target's distribution at position t+1, restricted to the
draft vocab and renormalised. Rows whose target argmax lies outside the draft vocab are
masked (the head cannot propose it; training towards the rest of the mass there only blurs).

Training-time test (EAGLE-3): the loss sums depths 1..`depth` of `HeadDraft.unroll`, depth j
weighted decay^(j-1); depth j reads the head's own state of depth j-1, as drafting does.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from train.distill.batching import trim
from train.distill.losses import expected_acceptance

DEPTH = 3
DECAY = 0.8
# train.head_loss's names: head_loss_fn's (tv, ce) weights.
HEAD_LOSSES = {"tv": {"tv": 1.0, "ce": 0.0}, "ce": {"tv": 0.0, "ce": 1.0}, "ce+tv": {"tv": 1.0, "ce": 1.0}}


@dataclass
class FeatureSet:
    """Target features of sequences, kept for several epochs. Per sequence i: ids [L],
    feats [L, nf*h] and final hidden [L, h] (bf16 to halve RAM), target argmax [L], and
    `start`: the first row that evaluation counts (the row predicting the second output token)."""

    ids: list[torch.Tensor] = field(default_factory=list)
    feats: list[torch.Tensor] = field(default_factory=list)
    final: list[torch.Tensor] = field(default_factory=list)
    argmax: list[torch.Tensor] = field(default_factory=list)
    start: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def n_tokens(self) -> int:
        return sum(int(x.numel()) for x in self.ids)

    def extend(self, other: "FeatureSet") -> None:
        for name in ("ids", "feats", "final", "argmax", "start"):
            getattr(self, name).extend(getattr(other, name))


def _batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices grouped by similar length, each group within token_budget padded tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= token_budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _pad(rows: Sequence[torch.Tensor], value: float = 0) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True, padding_value=value)


@torch.no_grad()
def compute_features(target: Any, seqs: Sequence[Sequence[int]], layers: tuple[int, ...], *,
                     starts: Sequence[int] | None = None, token_budget: int = 4096,
                     progress: Callable[[int], None] | None = None) -> FeatureSet:
    """One no-grad target forward per batch of sequences (right-padded; causal attention keeps
    the padding out of every real position). `progress(n_tokens)` after each batch."""
    w = target.lm_head.weight
    dev = w.device  # features stay where the target is: a GPU trains on them there
    lens = [len(s) for s in seqs]
    fs = FeatureSet()
    slots: dict[int, tuple] = {}
    for group in _batches(lens, token_budget):
        ids = _pad([torch.tensor(seqs[i], dtype=torch.long) for i in group])
        mask = _pad([torch.ones(lens[i], dtype=torch.long) for i in group])
        out = target.model(input_ids=ids.to(dev), attention_mask=mask.to(dev), output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1)
        final = out.last_hidden_state
        for b, i in enumerate(group):
            n = lens[i]
            # The full-vocab logits in slices of 256 rows: [n, V] at once would be n * 200 KB.
            am = torch.cat([(final[b, s:min(s + 256, n)] @ w.T).argmax(-1) for s in range(0, n, 256)]).cpu()
            slots[i] = (ids[b, :n].clone(), feats[b, :n].to(torch.bfloat16), final[b, :n].to(torch.bfloat16), am)
        if progress:
            progress(sum(lens[i] for i in group))
    for i in range(len(seqs)):
        a, f, h, m = slots[i]
        fs.ids.append(a)
        fs.feats.append(f)
        fs.final.append(h)
        fs.argmax.append(m)
        fs.start.append(0 if starts is None else max(int(starts[i]) - 2, 0))
    return fs


@dataclass
class HeadBatch:
    feats: torch.Tensor  # [B, T, nf*h] rows 0..L-2
    next_ids: torch.Tensor  # [B, T] x_{t+1}
    final: torch.Tensor  # [B, T, h] target's final hidden at t+1
    target_argmax: torch.Tensor  # [B, T] target argmax at t+1
    valid: torch.Tensor  # [B, T] bool: a real row
    start: torch.Tensor  # [B] first evaluated row
    n_tokens: int
    n_records: int = 1  # 0: a null batch (trainer collectives)


def collate(fs: FeatureSet, idx: Sequence[int]) -> HeadBatch:
    """A batch on the device of the features (token ids and argmax are kept on the CPU)."""
    rows = [fs.ids[i].numel() - 1 for i in idx]
    dev = fs.feats[idx[0]].device
    return HeadBatch(
        feats=_pad([fs.feats[i][:-1].float() for i in idx]),
        next_ids=_pad([fs.ids[i][1:] for i in idx]).to(dev),
        final=_pad([fs.final[i][1:].float() for i in idx]),
        target_argmax=_pad([fs.argmax[i][1:] for i in idx], -1).to(dev),
        valid=_pad([torch.ones(r, dtype=torch.bool) for r in rows], False).to(dev),
        start=torch.tensor([fs.start[i] for i in idx], device=dev),
        n_tokens=sum(rows),
        n_records=len(rows),
    )


def null_head_batch(feat_dim: int, hidden: int) -> HeadBatch:
    """One padding row and no records: an online trainer's step that takes part in the
    collectives (and ZeRO-3's gathers) but contributes nothing: zero loss, zero gradients."""
    return HeadBatch(feats=torch.zeros(1, 1, feat_dim), next_ids=torch.zeros(1, 1, dtype=torch.long),
                     final=torch.zeros(1, 1, hidden), target_argmax=torch.full((1, 1), -1, dtype=torch.long),
                     valid=torch.zeros(1, 1, dtype=torch.bool), start=torch.zeros(1, dtype=torch.long),
                     n_tokens=0, n_records=0)


def head_loss_fn(w_target: torch.Tensor, depth: int = DEPTH, decay: float = DECAY, rows: str = "all",
                 tv: float = 0.0, ce: float = 1.0):
    """loss_fn(model, batch) for DistillEngine.train_batch: soft cross-entropy of each depth's
    draft logits against the target over the draft vocab, depth j weighted decay^(j-1).
    w_target: the target's LM head [V, h] (frozen). A batch with no records or no in-vocab row
    gives exactly 0, still attached to the graph (every rank of a step must call backward).
    rows: "all", every row of the sequence (prompt rows included: the warm start's teacher
    records and ShareGPT text); "outputs", the rows from each sequence's `start` on, the rows
    whose token serving drafts and the gate scores (an online record's prompt is most of its
    rows, and text the head is never asked to draft).
    tv, ce: each depth's loss is ce x the soft cross-entropy + tv x the total variation
    1 - sum(min(p, q)), the rejection rate the gate's acceptance bound measures (HEAD_LOSSES
    names the online trainer's choices, train.head_loss)."""
    if rows not in ("all", "outputs"):
        raise ValueError(f"rows must be 'all' or 'outputs', got {rows!r}")
    if tv < 0 or ce < 0 or tv + ce <= 0:
        raise ValueError(f"tv and ce are weights >= 0, not both 0; got tv={tv}, ce={ce}")

    def fn(model: torch.nn.Module, batch: HeadBatch) -> torch.Tensor:
        inner = model.module if hasattr(model, "module") else model
        with torch.no_grad():
            in_vocab = inner.t2d()[batch.target_argmax.clamp(min=0)] & batch.valid
        counted_from = batch.start if rows == "outputs" else torch.zeros_like(batch.start)
        return _rows_loss(model, batch, w_target[inner.d2t], in_vocab, counted_from, depth, decay, tv, ce)

    return fn


def windows(valid: torch.Tensor, start: torch.Tensor, back: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's window of rows from start - back (at least 0) to its last row:
    (first [B], rows [B, W], the sequence row of each window row, rows past the end included)."""
    first = (start - back).clamp(min=0)
    width = max(int((valid.sum(1) - first).max()), 1) if first.numel() else 1
    return first, first.view(-1, 1) + torch.arange(width, device=valid.device).view(1, -1)


def _rows_loss(model: torch.nn.Module, batch: HeadBatch, w_d: torch.Tensor, in_vocab: torch.Tensor,
               counted_from: torch.Tensor, depth: int, decay: float, tv: float = 0.0, ce: float = 1.0
               ) -> torch.Tensor:
    """head_loss_fn's loss on the in-vocab rows from each sequence's `counted_from` row on: the
    unroll in a window per sequence from its first chain start that reaches them
    (HeadDraft.unroll_windows), the LM head and the targets on the counted rows alone (the same
    rows at every depth; depth j drops rows t < j-1, which no chain reaches)."""
    first, rows = windows(batch.valid, counted_from, depth - 1)
    t = batch.valid.shape[1]
    at_rows = rows.clamp(max=t - 1)
    counted = in_vocab.gather(1, at_rows) & (rows < t) & (rows >= counted_from.view(-1, 1))
    if batch.n_records == 0:
        counted = torch.zeros_like(counted)
    with torch.no_grad():
        final = batch.final.gather(1, at_rows.unsqueeze(-1).expand(-1, -1, batch.final.shape[-1]))
        # float32 targets: under bfloat16 autocast the product is bfloat16, and a bfloat16 p
        # both rounds the targets and makes every product with the float32 log-probabilities
        # (forward and backward) take PyTorch's mixed-dtype path, several times slower.
        p = torch.softmax((final[counted] @ w_d.T).float(), dim=-1)  # [N, V_d]
    outs = model(batch.feats, batch.next_ids, depth, first, counted)
    at = rows[counted]  # [N] each counted row's index
    total = outs[0].new_zeros(()) + outs[0].sum() * 0  # attached to the graph with no counted row
    for j, logits in enumerate(outs, start=1):
        m = (at >= j - 1).float()
        log_q = F.log_softmax(logits, dim=-1)
        loss = -(p * log_q).sum(-1) * ce if ce else 0.0
        if tv:
            loss = loss + tv * (1 - torch.minimum(p, log_q.float().exp()).sum(-1))
        total = total + decay ** (j - 1) * (loss * m).sum() / m.sum().clamp(min=1)
    return total


@torch.no_grad()
def evaluate(head: Any, fs: FeatureSet, depth: int = DEPTH, token_budget: int = 4096,
             per_row: bool = False) -> dict[str, Any]:
    """Greedy agreement with the target per draft depth, the head unrolled on its own state
    (teacher-forced features would overstate depth >= 2), on rows from each sequence's start.
    alpha_est: mean of the depths; tokens_per_step: 1 + a1 + a1 a2 + ... for a chain of `depth`.
    per_row: also `agree_rows`, per sequence its depth-1 agreement row by row (bool [rows from
    its start on], entry j from row start + j), for a caller that wants some rows alone (the
    ones a serving engine drafted from)."""
    head.eval()
    hits = [0] * depth
    counts = [0] * depth
    in_vocab = total = 0
    t2d = head.t2d()
    rows_out: list[torch.Tensor] = [torch.zeros(0, dtype=torch.bool)] * len(fs.ids)
    for group in _batches([x.numel() for x in fs.ids], token_budget):
        b = collate(fs, group)
        first, rows = windows(b.valid, b.start, 0)  # no counted chain starts before a sequence's start
        states = head.unroll_windows(b.feats, b.next_ids, depth, first, rows.shape[1])
        t = b.valid.shape[1]
        at = rows.clamp(max=t - 1)
        real = b.valid.gather(1, at) & (rows < t)
        target = b.target_argmax.gather(1, at)
        for j, o in enumerate(states, start=1):
            m = real & (rows >= b.start.view(-1, 1) + j - 1)
            if per_row and j == 1:  # every window row (depth 1 counts them all), then the counted ones
                every = head.d2t[head.logits(o).argmax(-1)] == target
                for n, i in enumerate(group):
                    rows_out[i] = every[n, : int(real[n].sum())].cpu()
                agree = every[m]
            else:
                agree = head.d2t[head.logits(o[m]).argmax(-1)] == target[m]  # counted rows alone
            hits[j - 1] += int(agree.sum())
            counts[j - 1] += int(m.sum())
        in_vocab += int((t2d[target.clamp(min=0)] & real).sum())  # real: the rows from each start
        total += int(real.sum())
    acc = [h / c if c else 0.0 for h, c in zip(hits, counts)]
    chain = [math.prod(acc[: i + 1]) for i in range(depth)]
    out = {"agree_per_depth": acc, "alpha_est": sum(acc) / depth if depth else None,
           "tokens_per_step_est": 1 + sum(chain), "coverage": in_vocab / total if total else None,
           "rows": counts[0]}
    if per_row:
        out["agree_rows"] = rows_out
    return out


def coverage_curve(train_argmax: torch.Tensor, eval_argmax: torch.Tensor, vocab: int,
                   sizes: Sequence[int] = (1024, 2048, 4096, 8192, 16384, 32768)) -> dict[int, float]:
    """Fraction of `eval_argmax` tokens inside the V_d most frequent of `train_argmax`, per V_d."""
    counts = torch.bincount(train_argmax, minlength=vocab)
    order = torch.argsort(counts, descending=True)
    out = {}
    for v in sizes:
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[order[:v]] = True
        out[v] = float(mask[eval_argmax].float().mean()) if eval_argmax.numel() else 0.0
    return out


def train_epochs(engine: Any, fs: FeatureSet, loss_fn: Callable, *, epochs: int, token_budget: int,
                 seed: int = 0, log: Callable[[str], None] = print, log_every: int = 20) -> list[float]:
    """Epochs over `fs` in seeded random batches of ~token_budget tokens, one engine step each."""
    losses: list[float] = []
    batches = _batches([x.numel() for x in fs.ids], token_budget)
    for epoch in range(epochs):
        order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        for n, i in enumerate(order):
            losses.append(engine.train_batch(collate(fs, batches[i]), loss_fn))
            if (n + 1) % log_every == 0 or n + 1 == len(order):
                recent = losses[-log_every:]
                log(f"epoch {epoch + 1}/{epochs} batch {n + 1}/{len(order)} loss {sum(recent) / len(recent):.3f}")
    return losses


def records_features(target: Any, records: Sequence[Any], layers: tuple[int, ...],
                     max_seq_len: int | None = None) -> FeatureSet:
    """Served records (infra.records.schema.Record) -> target features over prompt + output, with
    evaluation starting at the outputs: what an online trainer of the head steps on.
    max_seq_len: cut each record as train/distill/batching.py cuts it for a layer draft."""
    cut = [trim(r, max_seq_len or sys.maxsize) for r in records]
    return compute_features(target, [seq.tolist() for seq, _, _ in cut], layers, starts=[p for _, p, _ in cut])


@torch.no_grad()
def estimate_alpha_head(head: Any, target: Any, records: Sequence[Any], max_seq_len: int | None = None
                        ) -> float | None:
    """A candidate head's α estimate on held-out records: greedy agreement per depth, the head
    unrolled on its own state (teacher-forced features would overstate depth >= 2)."""
    if not records:
        return None
    return evaluate(head, records_features(target, records, head.feature_layers, max_seq_len))["alpha_est"]


@torch.no_grad()
def per_record_acceptance_head(head: Any, target: Any, records: Sequence[Any], max_seq_len: int,
                               depth: int = DEPTH, features: Any = None) -> list[tuple[float, int]]:
    """(sum over its positions of the head's expected acceptance, positions) per record, in
    order: what the paired gate needs, on the terms train/gate/evaluator.py's per_record_acceptance
    scores a layer draft, so a head and a layer version pair up. The same positions (the
    outputs `trim` keeps) and the same measure (min(p, q) summed over the record's target
    top-k, the lower bound); per position, the mean over the depths 1..depth whose chain
    starts at a real row, the head unrolled on its own state, as drafting runs it.
    `features`: records_features(target, records, head.feature_layers, max_seq_len) when the
    caller scores several heads on the same records (the target's forward is most of the cost)."""
    return [(b, n) for b, _, n in per_record_scores_head(head, target, records, max_seq_len, depth, features)]


@torch.no_grad()
def per_record_scores_head(head: Any, target: Any, records: Sequence[Any], max_seq_len: int,
                           depth: int = DEPTH, features: Any = None) -> list[tuple[float, float, int]]:
    """(acceptance bound sum, greedy agreement sum, positions) per record from one unroll: the
    bound is per_record_acceptance_head's; greedy agreement is whether the head's greedy token
    is the target's (the top-1 of the record's top-k), what a greedy request's verify accepts,
    on the same positions and depths."""
    head.eval()
    fs = features if features is not None else records_features(target, records, head.feature_layers, max_seq_len)
    dev = head.d2t.device
    inv = torch.full((head.vocab_size,), head.draft_vocab, dtype=torch.long, device=dev)  # V_d: not in vocab
    inv[head.d2t] = torch.arange(head.draft_vocab, device=dev)
    out: list[tuple[float, float, int]] = [(0.0, 0.0, 0)] * len(records)
    for group in _batches([x.numel() for x in fs.ids], 4096):
        b = collate(fs, group)
        # A record's first output is drafted from row start-depth+1.
        first, rows = windows(b.valid, b.start, depth - 1)
        states = head.unroll_windows(b.feats, b.next_ids, depth, first, rows.shape[1])
        for row, i in enumerate(group):
            out[i] = _record_acceptance(head, [o[row] for o in states], int(first[row]), inv, records[i],
                                        max_seq_len)
    return out


def _record_acceptance(head: Any, states: list[torch.Tensor], first: int, inv: torch.Tensor, rec: Any,
                       max_seq_len: int) -> tuple[float, float, int]:
    """One record's (bound sum, greedy sum, positions) from the output states per depth of its
    rows first.. ([T - first, h] each), the LM head taken on the rows that draft its outputs alone.
    Output k sits at sequence index p+k, so row p+k-2 drafts it; a position with no row
    (a one-token prompt's first output) the head cannot draft: acceptance 0."""
    _, p, n = trim(rec, max_seq_len)
    dev = states[0].device
    ids = inv[torch.as_tensor(np.asarray(rec.topk_ids[:n], dtype=np.int64), device=dev)]  # [n, K] draft index
    lp = torch.as_tensor(np.asarray(rec.topk_logprobs[:n], dtype=np.float32), device=dev)
    rows = torch.arange(n, device=dev) + p - 2
    total = torch.zeros(n, dtype=torch.float64, device=dev)
    agree = torch.zeros(n, dtype=torch.float64, device=dev)
    depths = torch.zeros(n, device=dev)
    for j, o in enumerate(states, start=1):
        ok = rows >= j - 1  # the depth-j chain through this row starts at row >= 0
        if not bool(ok.any()):
            continue
        z = head.logits(o[rows[ok] - first])
        z = torch.cat([z, z.new_full((z.shape[0], 1), float("-inf"))], -1)  # the out-of-vocab column
        total[ok] += expected_acceptance(z, ids[ok], lp[ok]).lower.double()
        agree[ok] += (z.argmax(-1) == ids[ok, 0]).double()  # out of the draft vocab: never equal
        depths[ok] += 1
    d = depths.clamp(min=1)
    return float((total / d).sum()), float((agree / d).sum()), n
