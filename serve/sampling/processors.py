"""Logits processors (penalties, logit bias, min_tokens) and returned log-probabilities.

Pure functions over tensors, no framework beyond torch, so every rule is unit-tested in
milliseconds (tests/test_processors.py).

The processors shape the target's logits before the warp (temperature, top-k, top-p:
serve/sampling/verify.py), and the draft's alike, so p and q stay two distributions over the same
prefix and speculative sampling stays exact. Each row sees the tokens its position conditions
on: row j of a verify block sees the committed output plus drafts 0..j-1, and the draft's
row at depth i sees the output plus its own drafts 0..i-1, which is what decoding that
position alone would see. (Verification is exact for any q drawn from; processing q only
keeps acceptance up.)

Semantics are vLLM's (and OpenAI's for the presence and frequency penalties), in the order
of vLLM's sampler:
1. logit_bias: added to the listed ids' logits;
2. min_tokens: the stop ids' logits are -inf while fewer than min_tokens tokens are out;
3. repetition_penalty r, over tokens of the prompt or the output: a positive logit is
   divided by r, a negative one multiplied by it;
4. frequency_penalty f and presence_penalty a, over tokens of the output only:
   logit - f * count - a * (count > 0).

Log-probabilities returned to clients (token_logprobs) are those of the raw target
distribution, before any processor or warp: vLLM's default (its "raw_logprobs" mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from serve.sampling.bounds import BIAS_RANGE, PENALTY_RANGE


@dataclass(frozen=True)
class ProcessorParams:
    """A request's processors; the defaults change nothing."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    min_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_RANGE <= getattr(self, name) <= PENALTY_RANGE:
                raise ValueError(f"{name} must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for tok, bias in self.logit_bias:
            if tok < 0 or not -BIAS_RANGE <= bias <= BIAS_RANGE:
                raise ValueError(f"logit_bias needs token ids >= 0 and values in [-{BIAS_RANGE:g}, "
                                 f"{BIAS_RANGE:g}], got {tok}: {bias}")

    @property
    def active(self) -> bool:
        return self != ProcessorParams()


class LogitsProcessor:
    """One request's processors and the counts they read: the output's token counts and the
    prompt's tokens (for repetition_penalty), on the device of the logits they process."""

    def __init__(self, params: ProcessorParams, prompt: Sequence[int], stop_ids: Iterable[int], vocab_size: int,
                 device: torch.device):
        self.params = params
        self.vocab_size = vocab_size
        self.counts = torch.zeros(vocab_size, device=device)  # [V] output tokens, float for the penalty math
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [V] prompt or output
        self.seen[torch.tensor(list(prompt), dtype=torch.long, device=device)] = True
        self.bias = torch.zeros(vocab_size, device=device)  # [V]
        if params.logit_bias:
            ids, vals = zip(*params.logit_bias)
            self.bias[torch.tensor(ids, dtype=torch.long, device=device)] = torch.tensor(vals, device=device)
        self.stop = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [V] ids min_tokens holds back
        stops = [t for t in stop_ids if 0 <= t < vocab_size]
        if stops:
            self.stop[torch.tensor(stops, dtype=torch.long, device=device)] = True
        self.n_out = 0

    def add(self, tokens: Sequence[int]) -> None:
        """Committed output tokens (host ints)."""
        if not tokens:
            return
        idx = torch.tensor(list(tokens), dtype=torch.long, device=self.counts.device)
        self.counts.index_add_(0, idx, torch.ones(idx.shape[0], device=self.counts.device))
        self.seen[idx] = True
        self.n_out += len(tokens)

    def apply(self, logits: torch.Tensor, drafts: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
        """Processed logits [m, C] (float32, a new tensor) of logits [m, C].

        drafts [L] long (L >= m - 1): tokens after the committed output; the last row sees all
        of them, each earlier row one fewer (a verify block: L = m - 1, row j sees drafts[:j];
        a draft's next row: m = 1, it sees every draft so far). columns [C]: the target id of
        each logit column (a draft over a reduced vocabulary), None for the full vocab."""
        m, n_drafts = logits.shape[0], drafts.shape[0]
        first = n_drafts - (m - 1)  # drafts row 0 sees
        if first < 0:
            raise ValueError(f"{m} rows need at least {m - 1} drafts, got {n_drafts}")
        extra = self._draft_counts(drafts, m, first)  # [m, V] or None

        def pick(v: torch.Tensor) -> torch.Tensor:
            return v if columns is None else v.index_select(-1, columns)

        p = self.params
        x = logits.float()
        if p.logit_bias:
            x = x + pick(self.bias)
        if p.min_tokens:
            out_len = self.n_out + first + torch.arange(m, device=x.device)
            held = (out_len < p.min_tokens).unsqueeze(1) & pick(self.stop).unsqueeze(0)
            x = x.masked_fill(held, float("-inf"))
        counts = self.counts.unsqueeze(0) if extra is None else self.counts + extra  # [1 or m, V]
        if p.repetition_penalty != 1.0:
            seen = pick(self.seen.unsqueeze(0) | (counts > 0))
            r = p.repetition_penalty
            x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        if p.frequency_penalty or p.presence_penalty:
            c = pick(counts)
            x = x - p.frequency_penalty * c - p.presence_penalty * (c > 0).float()
        return x

    def _draft_counts(self, drafts: torch.Tensor, m: int, first: int) -> torch.Tensor | None:
        """[m, V]: row j counts drafts[:first + j]; None when no row sees a draft."""
        n = drafts.shape[0]
        if n == 0 or first + m - 1 == 0:
            return None
        device = self.counts.device
        sees = torch.arange(n, device=device).unsqueeze(0) < (first + torch.arange(m, device=device)).unsqueeze(1)
        hot = torch.nn.functional.one_hot(drafts.to(device), self.vocab_size).float()  # [L, V]
        return sees.float() @ hot


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per emitted token: (its log-probability, the `top` most likely (id, log-probability)
    pairs), under the raw distribution of logits [m, V] (row i scored tokens[i]); one host read."""
    m = len(tokens)
    if m == 0:
        return []
    lp = torch.log_softmax(logits[:m].float(), dim=-1)
    idx = torch.tensor(list(tokens), dtype=torch.long, device=lp.device).unsqueeze(1)
    chosen = lp.gather(1, idx).squeeze(1)
    if top > 0:
        vals, ids = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
        host_vals, host_ids, host_chosen = vals.tolist(), ids.tolist(), chosen.tolist()
    else:
        host_vals, host_ids, host_chosen = [[]] * m, [[]] * m, chosen.tolist()
    return [(c, list(zip(i, v))) for c, i, v in zip(host_chosen, host_ids, host_vals)]
