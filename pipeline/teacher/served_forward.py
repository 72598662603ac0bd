"""The served target's forward that an online head trainer takes its features from.

`train` cannot import `serve`, so the pipeline builds this forward and hands its factory,
`served_forward`, to the trainer (train/online/served.py says why a head trains on the served
format and what the forward returns). The target is loaded as serving loads it (its configured
dtype and quant) and run by the runner serving makes of it (serve/model/factory.py make_runner):
for an int4 target on the CPU, the native int4 forward.

Blocks. The native forward computes a row the same way whatever rows run beside it, so its
features here equal, bit for bit, those the engine fed the head, whatever prompt chunks and
verify blocks serving cut the sequence into; blocks of BLOCK_ROWS bound the [rows, vocab] logits
each holds. PyTorch's int4 kernels (the runner where the native one cannot load) are row-exact
only up to ROW_EXACT_MAX_T rows, the decode's arithmetic, so they take blocks of that many:
an output row then equals its decode; a prompt row differs from serving's wide prompt chunks
by rounding only.

Greedy tokens. A row's greedy token takes the LM head, about a fifth of a row's arithmetic; the
trainer asks for it only where it reads it (`logits_from`: the output rows its loss counts; none
for the records it scores), and the rows before run as a prompt does (`prefill`), whose
features are the same bits.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from infra.config import OSDConfig
from pipeline.teacher.feature_recorder import split_final, with_last
from serve.model.runner import ROW_EXACT_MAX_T
from train.teacher.features import FeatureRows

BLOCK_ROWS = 256  # rows per native forward: [256, V] float32 logits at a time, not [L, V]


def served_forward(cfg: OSDConfig) -> tuple[Any, str]:
    """A train.online.served.ServedFactory: (the forward, or None where the trainer keeps its float32
    copy's features, and the line that says which and why)."""
    from infra.target import load_target
    from serve.model.factory import make_runner

    model_cfg = cfg.model.resolved()
    if model_cfg.quant != "int4":
        return None, (f"head features from the float32 training copy: the target is served in {model_cfg.dtype}, "
                      "unquantized (only an int4 target's are taken from its served forward)")
    loaded = load_target(cfg.model.target, cfg.model, progress=False)
    try:
        runner = make_runner(loaded.model, cfg.train.max_seq_len, "int4", cfg.model.cpu_kernels)
    except ValueError as e:  # model.cpu_kernels native where the library cannot load
        return None, f"head features from the float32 training copy: the served runner cannot be built here ({e})"
    forward = RunnerForward(loaded.model, runner)
    return forward, f"head features from the served target: int4 on {forward.kernels}, as serving feeds the head"


class RunnerForward:
    """A train.online.served.ServedForward over one runner: one sequence at a time in one
    reused cache."""

    def __init__(self, model: Any, runner: Any):
        from serve.model.native_runner import NativeLlamaRunner

        native = isinstance(runner, NativeLlamaRunner)
        self.runner, self.model = runner, model
        self.kernels = "the native forward" if native else "PyTorch's int4 kernels"
        self.block = BLOCK_ROWS if native else ROW_EXACT_MAX_T
        self._cache: Any = None

    def __call__(self, seqs: Sequence[Sequence[int]], layers: tuple[int, ...],
                 logits_from: Sequence[int] | None = None) -> list[FeatureRows]:
        """`logits_from[i]`: sequence i's first row whose greedy token is wanted (argmax -1 before
        it; None: every row's)."""
        asked = with_last(tuple(layers), self.model.config.num_hidden_layers)
        froms = [0] * len(seqs) if logits_from is None else list(logits_from)
        if len(froms) != len(seqs):
            raise ValueError(f"logits_from has {len(froms)} rows for {len(seqs)} sequences")
        return [self._rows([int(t) for t in seq], tuple(layers), asked, start) for seq, start in zip(seqs, froms)]

    def _rows(self, tokens: list[int], layers: tuple[int, ...], asked: tuple[int, ...],
              logits_from: int) -> FeatureRows:
        """One sequence's rows: its tokens but the last (serving never feeds that one)."""
        ids = torch.tensor(tokens[:-1], dtype=torch.long)
        if self._cache is None:
            self._cache = self.runner.new_cache()
        self._cache.truncate(0)
        feats, final, argmax = [], [], []
        for s in range(0, ids.numel(), self.block):
            e = min(s + self.block, ids.numel())
            cut = min(max(logits_from, s), e)  # rows [s, cut) without their greedy token
            f = []
            if cut > s:
                f.append(self.runner.prefill(ids[s:cut], self._cache, asked))
                argmax.append(torch.full((cut - s,), -1, dtype=torch.long))
            if e > cut:
                logits, rest = self.runner.forward_features(ids[cut:e], self._cache, asked)
                f.append(rest)
                argmax.append(logits.argmax(-1))  # the served runner's own greedy token
            head, fin = split_final(torch.cat(f), asked, layers, self.model.model.norm.weight,
                                    self.model.config.rms_norm_eps)
            feats.append(head.to(torch.bfloat16))
            final.append(fin.to(torch.bfloat16))
        if not feats:  # a one-token sequence has no row
            width, h = len(layers) * self.model.config.hidden_size, self.model.config.hidden_size
            return FeatureRows(ids, torch.empty(0, width, dtype=torch.bfloat16), torch.empty(0, h, dtype=torch.bfloat16),
                               torch.empty(0, dtype=torch.long))
        return FeatureRows(ids, torch.cat(feats), torch.cat(final), torch.cat(argmax))
