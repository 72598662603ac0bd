"""The warm start's teacher set: which ShareGPT prompts the target answers, the answers as
records (cached on disk and grown across runs, train/teacher/store.py), and their train /
held-out split. Shared by both families' warm starts (train/warm/layer.py,
train/warm/head.py) and the trainer's replay of them."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from infra.config import OSDConfig

# Prompts per teacher cache shard: the work a kill can lose, and the step at which the budget
# is checked; a few times train.warm_batch_size keeps the engine's batch full.
SHARD_PROMPTS = 256
# On a CUDA device the teacher is one static batch of this many prompts per forward
# (train/teacher/batch.py), where the GPU's decode rows cost little more than one; the shards
# grow to hold a batch.
CUDA_BATCH_SIZE = 1024


def warm_prompts(cfg: OSDConfig, n: int, max_chars: int | None = None, split: str = "train", domain: str | None = None,
                 prompts: list | None = None):
    """The first n short prompts of a split, of the human turns train.warm_turns names.
    `prompts`: ShareGPT already loaded (any split), so a caller that needs several selections
    parses the file (~2.5 s) once; read from disk if None."""
    if prompts is None:
        from infra.prompts import load_sharegpt

        prompts = load_sharegpt(cfg.data, split=split, turns=cfg.train.warm_turns)
    max_chars = cfg.train.warm_prompt_chars if max_chars is None else max_chars
    return [p for p in prompts if p.split == split and len(p.text) <= max_chars
            and (domain is None or p.domain == domain)][:n]


def engine_teacher_tag(cfg: OSDConfig) -> str:
    """The cache-key name of the serving engine as teacher generator (its weight format
    decides its answers); pipeline/teacher/engine.py generates under this name."""
    return f"engine-{cfg.model.resolved().quant}"


def warm_budget_s(cfg: OSDConfig) -> float | None:
    """train.warm_budget_minutes in seconds: how long the warm start may generate, or None."""
    m = cfg.train.warm_budget_minutes
    return None if m is None else m * 60.0


def teacher_store(cfg: OSDConfig, loaded: Any, generator: str, root: str | Path | None = None) -> Any:
    """The on-disk answers (train/teacher/store.py) of the target under `generator` (the
    engine's tag, or "hf") with this config's max_new_tokens and capture top-k."""
    from infra.drafts.layer import target_ref
    from train.teacher.store import STORE_FORMAT, TeacherStore

    key = {"kind": "teacher", "format": STORE_FORMAT, "target": target_ref(loaded), "generator": generator,
           "max_new_tokens": cfg.train.warm_max_new_tokens, "top_k": cfg.serve.capture_top_k, "decode": "greedy"}
    gpu = on_cuda(loaded)
    # On a GPU a shard holds at least one static batch, and its features stay in device memory:
    # 50k answers' rows are tens of GB, more than such a machine's disk, and remade in minutes.
    return TeacherStore(root or Path(cfg.state_dir) / "teacher", key,
                        shard_prompts=max(SHARD_PROMPTS, CUDA_BATCH_SIZE) if gpu else SHARD_PROMPTS,
                        features_on_disk=not gpu)


def on_cuda(loaded: Any) -> bool:
    """Whether the loaded target's weights are on a CUDA device."""
    return next(loaded.model.parameters()).device.type == "cuda"


def batch_teacher(cfg: OSDConfig, loaded: Any) -> Any:
    """The generator for a target on a CUDA device, or where train.warm_teacher is "batch"
    (train/teacher/batch.py: static batches of CUDA_BATCH_SIZE, features captured),
    else None: the caller's own choice stands."""
    if not on_cuda(loaded) and cfg.train.warm_teacher != "batch":
        return None
    from infra.records.tokens import eos_token_ids
    from train.teacher.batch import StaticBatchTeacher

    tok = loaded.tokenizer
    eos = eos_token_ids(tok, getattr(loaded.model.generation_config, "eos_token_id", None))
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    return StaticBatchTeacher(loaded.model, eos, pad, batch_size=CUDA_BATCH_SIZE)


def teacher_records(cfg: OSDConfig, loaded: Any, prompts: list, *, progress: bool = True, generate: Any = None,
                    budget_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> list:
    """The target's records for `prompts`, in prompt order: those in the on-disk cache, the
    rest generated and added to it. generate: a train.teacher.data.BatchGenerate (the serving
    engine); default Hugging Face. budget_s: generation stops starting shards after this many
    seconds of `clock`, and only the prompts answered by then have records."""
    return teacher_answers(cfg, loaded, prompts, progress=progress, generate=generate, budget_s=budget_s,
                           clock=clock).records


def teacher_answers(cfg: OSDConfig, loaded: Any, prompts: list, *, progress: bool = True, generate: Any = None,
                    budget_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                    feature_layers: tuple[int, ...] | None = None) -> Any:
    """teacher_records as a train.teacher.store.Filled; with feature_layers, also the features
    of those layers captured during generation, where `generate` captures them (a
    train.teacher.data.CapturingGenerate: the serving engine) or an earlier run's did."""
    from train.teacher.data import generate_teacher_answers

    tc = cfg.train
    store = teacher_store(cfg, loaded, generate.tag if generate is not None else "hf")

    def build(chunk, on_answer):
        return generate_teacher_answers(loaded.model, loaded.tokenizer, chunk, max_new_tokens=tc.warm_max_new_tokens,
                                        top_k=cfg.serve.capture_top_k, batch_size=tc.warm_batch_size,
                                        progress=on_answer, generate=generate, feature_layers=feature_layers or ())

    return store.fill(prompts, build, tokens_per_prompt=tc.warm_max_new_tokens, budget_s=budget_s, clock=clock,
                      progress=progress, feature_layers=feature_layers)


def cached_warm_records(cfg: OSDConfig, loaded: Any, root: str | Path | None = None) -> list:
    """The warm start's teacher train records that `osd draft init` left in its cache under
    `root` (default <state_dir>/teacher): all of them, or as many as its budget made, else [],
    never generated here (a replay that mixes them in must not spend minutes of target
    generation). All of them: v1's held-out split measured v1 once."""
    root = Path(root) if root is not None else Path(cfg.state_dir) / "teacher"
    prompts = warm_prompts(cfg, cfg.train.warm_prompts)
    for generator in (engine_teacher_tag(cfg), "hf"):  # whichever generator `osd draft init` used
        records = teacher_store(cfg, loaded, generator, root).cached(prompts)
        if records:
            return records
    return []


def split_held_out(records: list, every: int) -> tuple[list, list]:
    from train.gate.evaluator import is_held_out

    held = [r for r in records if is_held_out(r.request_id, every)]
    train = [r for r in records if not is_held_out(r.request_id, every)]
    return train, held
