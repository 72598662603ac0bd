"""The warm start's teacher set: which ShareGPT prompts the target answers, the answers as
records (cached on disk, train/teacher_data.py), and their train / held-out split. Shared by
both families' warm starts (train/warm_start.py, train/head_warm_start.py) and the trainer's
replay of them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from infra.config import OSDConfig


def warm_prompts(cfg: OSDConfig, n: int, max_chars: int = 600, split: str = "train", domain: str | None = None,
                 prompts: list | None = None):
    """The first n short prompts of a split. `prompts`: ShareGPT already loaded (any split), so a
    caller that needs several selections parses the file (~2.5 s) once; read from disk if None."""
    if prompts is None:
        from infra.prompts import load_sharegpt

        prompts = load_sharegpt(cfg.data, split=split)
    return [p for p in prompts if p.split == split and len(p.text) <= max_chars
            and (domain is None or p.domain == domain)][:n]


def engine_teacher_tag(cfg: OSDConfig) -> str:
    """The cache-key name of the serving engine as teacher generator (its weight format
    decides its answers); pipeline/teacher_engine.py generates under this name."""
    return f"engine-{cfg.model.resolved().quant}"


def _teacher_key(cfg: OSDConfig, loaded: Any, prompts: list, generator: str | None = None) -> dict[str, Any]:
    from infra.draft_model import target_ref

    key = {
        "target": target_ref(loaded),
        "prompts": hashlib.sha256(json.dumps([p.id for p in prompts]).encode()).hexdigest(),
        "max_new_tokens": cfg.train.warm_max_new_tokens,
        "top_k": cfg.serve.capture_top_k,
    }
    if generator is not None:  # absent for Hugging Face generate: caches made before keep their key
        key["generator"] = generator
    return key


def teacher_records(cfg: OSDConfig, loaded: Any, prompts: list, *, progress: bool = True,
                    generate: Any = None) -> list:
    """The target's records for `prompts`, from the on-disk cache when present.
    generate: a train.teacher_data.BatchGenerate (the serving engine); default Hugging Face."""
    from train.teacher_data import TeacherCache, generate_teacher_records

    tc = cfg.train
    key = _teacher_key(cfg, loaded, prompts, generate.tag if generate is not None else None)
    cache = TeacherCache(Path(cfg.state_dir) / "teacher", progress=progress)

    def build(chunk):
        return generate_teacher_records(loaded.model, loaded.tokenizer, chunk, max_new_tokens=tc.warm_max_new_tokens,
                                        top_k=cfg.serve.capture_top_k, batch_size=tc.warm_batch_size,
                                        progress=progress, generate=generate)

    return cache.get_or_build(key, build, items=prompts)


def cached_warm_records(cfg: OSDConfig, loaded: Any) -> list:
    """The warm start's teacher train records if `osd draft init` left them in this state dir's
    cache, else []: the trainer replays them (`train.warm_replay_fraction`) but never spends
    minutes of target generation on them. All of them: v1's held-out split measured v1 once,
    and the online gate scores on live held-out records, never on these."""
    from train.teacher_data import TeacherCache

    root = Path(cfg.train.warm_teacher_dir or Path(cfg.state_dir) / "teacher")
    prompts = warm_prompts(cfg, cfg.train.warm_prompts)
    cache = TeacherCache(root, progress=False)
    for generator in (engine_teacher_tag(cfg), None):  # whichever generator `osd draft init` used
        records = cache.get(_teacher_key(cfg, loaded, prompts, generator))
        if records:
            return records
    return []


def split_held_out(records: list, every: int) -> tuple[list, list]:
    from train.evaluator import is_held_out

    held = [r for r in records if is_held_out(r.request_id, every)]
    train = [r for r in records if not is_held_out(r.request_id, every)]
    return train, held
