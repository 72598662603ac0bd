"""Records -> training batches, packed to a token budget. Torch only, no services.

A record is (prompt ids [P], output ids [N], target top-k per output position [N, K]).
The draft reads prompt + output and is trained at the N positions that predicted the
outputs: position P-1+i predicts output i. Sequences longer than max_seq_len keep their
end (the newest context), dropping the oldest prompt tokens, and at most max_seq_len-1
output positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from infra.records.schema import Record


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] int64, right-padded with 0
    attention_mask: torch.Tensor  # [B, T] int64
    rows: torch.Tensor  # [M] int64: batch index of each trained position
    cols: torch.Tensor  # [M] int64: time index of each trained position
    topk_ids: torch.Tensor  # [M, K] int64
    topk_logprobs: torch.Tensor  # [M, K] float32
    accepted: torch.Tensor  # [M] bool
    draft_tokens: torch.Tensor  # [M] int64
    n_records: int
    n_tokens: int  # real (unpadded) tokens fed


def record_tokens(rec: Record, max_seq_len: int) -> int:
    return min(len(rec.prompt_ids) + len(rec.output_ids), max_seq_len)


def take_budget(buffer: list, token_budget: int, max_seq_len: int, key=lambda d: d) -> list:
    """Pop records from the front of `buffer` while they fit the budget (always at least one)."""
    out, used = [], 0
    while buffer:
        n = record_tokens(key(buffer[0]), max_seq_len)
        if out and used + n > token_budget:
            break
        out.append(buffer.pop(0))
        used += n
    return out


def trim(rec: Record, max_seq_len: int) -> tuple[np.ndarray, int, int]:
    """(sequence [keep_prompt + n_out] int64, keep_prompt, n_out): the record cut to max_seq_len
    as the module doc says. Both draft families train on these tokens."""
    prompt = np.asarray(rec.prompt_ids, dtype=np.int64)
    out = np.asarray(rec.output_ids, dtype=np.int64)
    n_out = min(len(out), max_seq_len - 1)
    keep_prompt = min(len(prompt), max_seq_len - n_out)
    if keep_prompt == 0:  # need at least one context token before the first output
        n_out -= 1
        keep_prompt = 1
    return np.concatenate([prompt[len(prompt) - keep_prompt:], out[:n_out]]), keep_prompt, n_out


def pack(records: Sequence[Record], max_seq_len: int) -> Batch:
    seqs, spans = [], []
    for rec in records:
        seq, keep_prompt, n_out = trim(rec, max_seq_len)
        seqs.append(seq)
        spans.append((keep_prompt, n_out))
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    rows, cols, tk_ids, tk_lp, acc, dt = [], [], [], [], [], []
    for b, (seq, (p, n), rec) in enumerate(zip(seqs, spans, records)):
        ids[b, : len(seq)] = torch.from_numpy(seq)
        mask[b, : len(seq)] = 1
        rows.append(torch.full((n,), b, dtype=torch.long))
        cols.append(torch.arange(p - 1, p - 1 + n, dtype=torch.long))
        tk_ids.append(torch.from_numpy(np.asarray(rec.topk_ids[:n], dtype=np.int64)))
        tk_lp.append(torch.from_numpy(np.asarray(rec.topk_logprobs[:n], dtype=np.float32)))
        acc.append(torch.from_numpy(np.asarray(rec.accepted[:n], dtype=bool)))
        dt.append(torch.from_numpy(np.asarray(rec.draft_tokens[:n], dtype=np.int64)))
    return Batch(ids, mask, torch.cat(rows), torch.cat(cols), torch.cat(tk_ids), torch.cat(tk_lp),
                 torch.cat(acc), torch.cat(dt), len(records), int(mask.sum()))


def position_logits(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Draft logits [M, V] at the trained positions only: the LM head runs on M rows, not B*T."""
    inner = model.module if hasattr(model, "module") else model
    hidden = inner.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    return inner.lm_head(hidden[batch.rows, batch.cols]).float()
