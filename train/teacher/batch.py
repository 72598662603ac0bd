"""Teacher answers in large static batches, with the head's features captured as they are made.

On a CUDA device a decode step of a thousand rows costs little more than a step of one (the
135M target's weights are read once per step either way), so the warm start answers
`batch_size` prompts per forward instead of the CPU engine's continuous batch of a few. It is
a train.teacher.data.CapturingGenerate over the Hugging Face model in the training dtype:

- Prompts are sorted by length and cut into batches of at most `batch_size` prompts and
  `batch_tokens` padded tokens (prompt + answer), left-padded, decoded greedily with a KV
  cache until every row has stopped or `max_new_tokens` were made. A row that has stopped
  keeps decoding (cheaper than compacting the batch); train/teacher/data.py cuts its answer
  after the first EOS, and its feature rows with it.
- Features: forward hooks on the head's layers take their outputs during the prefill and
  each decode step (no second pass, and not every layer's hidden state, which at a thousand
  rows of a long prompt would be tens of GB); the final norm's output and the greedy token of
  each row come from the same forward. They stay on the model's device in bfloat16, for the
  warm start to train on there.
- Answers equal Hugging Face `generate`'s on the same model (tests/test_teacher_batch.py), so
  the cache key names this generator "hf" too.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from infra.records.tokens import topk_logprobs
from train.teacher.data import left_pad
from train.teacher.features import FeatureRows

Answer = tuple[np.ndarray, np.ndarray, np.ndarray]


class StaticBatchTeacher:
    """Greedy answers (and captured features) of `model`, `batch_size` prompts per forward."""

    tag = "hf"

    def __init__(self, model: Any, eos: Sequence[int], pad: int, *, batch_size: int = 1024,
                 batch_tokens: int | None = None, row_chunk: int = 8192):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.eos, self.pad = model, [int(e) for e in eos], int(pad)
        self.batch_size = batch_size
        self.batch_tokens = batch_tokens or batch_size * 512
        self.row_chunk = row_chunk  # rows per full-vocab argmax over a prefill: [rows, V] at once

    def __call__(self, rows: list[list[int]], max_new_tokens: int, top_k: int, on_answer: Any) -> list[Answer]:
        return [a for a, _ in self._answer(rows, max_new_tokens, top_k, on_answer, ())]

    def capture(self, rows: list[list[int]], max_new_tokens: int, top_k: int, on_answer: Any,
                layers: tuple[int, ...]) -> list[tuple[Answer, FeatureRows]]:
        return self._answer(rows, max_new_tokens, top_k, on_answer, tuple(layers))

    def batches(self, lengths: Sequence[int], max_new_tokens: int) -> list[list[int]]:
        """Row indices, longest first, cut at batch_size rows or batch_tokens padded tokens."""
        out: list[list[int]] = []
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            if out and len(out[-1]) < self.batch_size and \
                    (len(out[-1]) + 1) * (lengths[out[-1][0]] + max_new_tokens) <= self.batch_tokens:
                out[-1].append(i)
            else:
                out.append([i])
        return out

    @torch.no_grad()
    def _answer(self, rows: list[list[int]], max_new_tokens: int, top_k: int, on_answer: Any,
                layers: tuple[int, ...]) -> list[Any]:
        out: list[Any] = [None] * len(rows)
        for group in self.batches([len(r) for r in rows], max_new_tokens):
            for i, got in zip(group, self._batch([rows[i] for i in group], max_new_tokens, top_k, layers)):
                out[i] = got if layers else (got, None)
                if on_answer is not None:
                    on_answer(len(got[0][0]) if layers else len(got[0]))
        return out

    def _batch(self, rows: list[list[int]], max_new_tokens: int, top_k: int, layers: tuple[int, ...]) -> list[Any]:
        from transformers import DynamicCache

        dev = next(self.model.parameters()).device
        inp, mask = (t.to(dev) for t in left_pad(rows, self.pad))
        width = inp.shape[1]
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        eos = torch.tensor(self.eos or [-1], device=dev)
        taps = _LayerTaps(self.model, layers)
        try:
            cache = DynamicCache()
            h = self._forward(inp, mask, pos, cache)  # [B, W, H] after the final norm
            prompt = (taps.take(h), h.to(torch.bfloat16), self._argmax(h)) if layers else None
            logits = h[:, -1].float() @ self._w().T
            toks, tops, steps = [], [], []
            done = torch.zeros(len(rows), dtype=torch.bool, device=dev)
            for t in range(max_new_tokens):
                tok = logits.argmax(-1)
                toks.append(tok)
                tops.append(topk_logprobs(logits, top_k))
                done |= torch.isin(tok, eos)
                if t + 1 == max_new_tokens or bool(done.all()):
                    break
                mask = torch.cat([mask, mask.new_ones((len(rows), 1))], 1)
                pos = pos[:, -1:] + 1
                h = self._forward(tok[:, None], mask, pos, cache)
                logits = h[:, -1].float() @ self._w().T
                if layers:
                    steps.append((taps.take(h), h.to(torch.bfloat16), logits.argmax(-1, keepdim=True)))
        finally:
            taps.remove()
        return self._unbatch(rows, width, toks, tops, prompt, steps)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self.model.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                               use_cache=True)
        return out.last_hidden_state

    def _w(self) -> torch.Tensor:
        return self.model.lm_head.weight.float()

    def _argmax(self, h: torch.Tensor) -> torch.Tensor:
        """[B, W] the greedy next token at every row of a prefill, in chunks of rows."""
        flat = h.reshape(-1, h.shape[-1])
        w = self._w()
        parts = [(flat[s:s + self.row_chunk].float() @ w.T).argmax(-1) for s in range(0, flat.shape[0], self.row_chunk)]
        return torch.cat(parts).view(h.shape[:2])

    def _unbatch(self, rows: list[list[int]], width: int, toks: list, tops: list, prompt: Any,
                 steps: list) -> list[Any]:
        gen = torch.stack(toks, 1).to(torch.int32).cpu().numpy()  # [B, n]
        ids = torch.stack([i for i, _ in tops], 1).to(torch.int32).cpu().numpy()
        lps = torch.stack([lp for _, lp in tops], 1).to(torch.float16).cpu().numpy()
        answers = [(gen[b].copy(), ids[b].copy(), lps[b].copy()) for b in range(len(rows))]
        if prompt is None:
            return answers
        # Row j of an answer of P prompt and n output tokens: the prompt's rows from the
        # prefill, output token j's (j < n-1) from the decode step it was the input of.
        feats = torch.cat([prompt[0]] + [s[0] for s in steps], 1) if steps else prompt[0]
        final = torch.cat([prompt[1]] + [s[1] for s in steps], 1) if steps else prompt[1]
        am = torch.cat([prompt[2]] + [s[2] for s in steps], 1).cpu() if steps else prompt[2].cpu()
        out = []
        for b, r in enumerate(rows):
            lo, hi = width - len(r), width + len(steps)
            seq = torch.tensor(list(r) + gen[b, :-1].tolist(), dtype=torch.long)
            out.append((answers[b], FeatureRows(seq, feats[b, lo:hi].clone(), final[b, lo:hi].clone(),
                                                am[b, lo:hi].long())))
        return out


class _LayerTaps:
    """Forward hooks that keep the outputs of the target's decoder layers `layers` from each
    forward, concatenated in layer order, bf16: what the head reads, hidden_states[i + 1],
    which for the last layer Hugging Face gives after the final norm (`take`'s argument)."""

    def __init__(self, model: Any, layers: tuple[int, ...]):
        self.layers, self.got = layers, {}
        blocks = model.model.layers
        self.last = len(blocks) - 1
        self.handles = [blocks[i].register_forward_hook(self._hook(i)) for i in layers if i != self.last]

    def _hook(self, i: int):
        def keep(_module: Any, _args: Any, output: Any) -> None:
            self.got[i] = (output[0] if isinstance(output, tuple) else output).to(torch.bfloat16)
        return keep

    def take(self, normed: torch.Tensor) -> torch.Tensor:
        out = torch.cat([normed.to(torch.bfloat16) if i == self.last else self.got[i] for i in self.layers], -1)
        self.got = {}
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
