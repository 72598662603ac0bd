"""The serving engine as the warm start's teacher.

`osd draft init` asks the target for its own greedy answers. Hugging Face `generate` pads a
batch to its longest prompt, decodes in float32 and holds every row until the slowest one
ends. The serving engine instead batches continuously (serve/engine/scheduler.py): a finished answer
frees its slot for the next prompt at once, prompts are prefilled in chunks beside the
others' decode steps, and the weights are in the serving format (int4 by default), so the
records are the distribution users are actually served, as live capture records are.

`train` cannot import `serve` (layers point down), so the pipeline builds this generator
and hands it to `train.warm.layer` as a `train.teacher.data.BatchGenerate`.

`capture` also records the target features a head draft reads, as the answers are generated
(pipeline/teacher/feature_recorder.py, attached as the requests' draft): the head's warm start then
needs no second forward pass over them (train/teacher/features.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from infra.config import OSDConfig
from train.teacher.features import FeatureRows
from train.teacher.sets import engine_teacher_tag

Answer = tuple[np.ndarray, np.ndarray, np.ndarray]  # output ids, top-k ids, top-k log-probs


class EngineTeacher:
    """Greedy answers with top-k capture through a SpecEngine with no draft of its own (capture
    attaches the feature recorder), up to `train.warm_batch_size` prompts in one batch. The
    target loads on first use."""

    def __init__(self, cfg: OSDConfig, loaded: Any = None):
        self.cfg = cfg
        self.tag = engine_teacher_tag(cfg)
        self._loaded = loaded  # tests pass a tiny model; else the serving target, loaded lazily
        self._engine_now: Any = None

    def engine(self, top_k: int, max_len: int) -> Any:
        """One engine for every call (its cost profile and caches warm up once), rebuilt only
        for another top-k or a longer context than it was made for."""
        from infra.target import load_target
        from serve.engine.core import EngineOptions, SpecEngine

        eng = self._engine_now
        if eng is None or eng.options.capture_top_k != top_k or eng.options.max_seq_len < max_len:
            if self._loaded is None:
                self._loaded = load_target(self.cfg.model.target, self.cfg.model, progress=False)
            # k 1 and a fixed k: the engine attaches a per-request draft only with k > 0, and
            # the feature recorder proposes nothing (no verify rows, no cost profiling).
            opts = dataclasses.replace(
                EngineOptions.from_config(self.cfg.serve, self.cfg.model), k=1, k_policy="fixed", tree="",
                capture_top_k=top_k, max_concurrency=self.cfg.train.warm_batch_size,
                max_seq_len=max(self.cfg.serve.max_seq_len, max_len))
            self._engine_now = eng = SpecEngine(self._loaded.model, None, self._loaded.tokenizer, opts)
        return eng

    def __call__(self, rows: list[list[int]], max_new_tokens: int, top_k: int,
                 on_answer: Callable[[int], None] | None) -> list[Answer]:
        """on_answer: told each answer's token count as it finishes (in finishing order), so the
        caller's bar (train/teacher/progress.py) counts tokens, tokens/s and the ETA across calls."""
        return [_answer(r) for r in self._generate(rows, max_new_tokens, top_k, on_answer, None)]

    def capture(self, rows: list[list[int]], max_new_tokens: int, top_k: int,
                on_answer: Callable[[int], None] | None, layers: tuple[int, ...]) -> list[tuple[Answer, FeatureRows]]:
        """The answers with their feature rows of the target's `layers` (a
        train.teacher.data.CapturingGenerate), recorded as they were generated."""
        from pipeline.teacher.feature_recorder import FeatureRecorder

        if not rows:
            return []
        self.engine(top_k, max(len(r) for r in rows) + max_new_tokens)  # loads the target the recorder reads
        recorder = FeatureRecorder(self._loaded.model, layers)
        results = self._generate(rows, max_new_tokens, top_k, on_answer, recorder)
        return [(_answer(r), recorder.take(r.prompt_ids + r.output_ids)) for r in results]

    def _generate(self, rows: list[list[int]], max_new_tokens: int, top_k: int,
                  on_answer: Callable[[int], None] | None, recorder: Any) -> list[Any]:
        from serve.engine.sequence import GenerationParams

        if not rows:
            return []
        eng = self.engine(top_k, max(len(r) for r in rows) + max_new_tokens)
        params = GenerationParams(max_new_tokens=max_new_tokens, capture=True, speculate=recorder is not None)

        def done(_i: int, result: Any) -> None:
            if on_answer is not None:
                on_answer(len(result.output_ids))

        return eng.generate_many(rows, params, draft=recorder, on_result=done)


def _answer(r: Any) -> Answer:
    return np.asarray(r.output_ids, dtype=np.int32), r.capture.topk_ids, r.capture.topk_logprobs


def teacher_for(cfg: OSDConfig) -> EngineTeacher | None:
    """The generator `train.warm_teacher` names: the engine, or None for Hugging Face `generate`.
    None on a CUDA device too: there the warm start answers in static batches of its own
    (train/teacher/batch.py), where the engine would decode one request at a time."""
    if cfg.model.device.startswith("cuda"):
        return None
    return EngineTeacher(cfg) if cfg.train.warm_teacher == "engine" else None
