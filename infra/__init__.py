"""The shared plumbing under serving and training. Imports nothing from serve/, train/ or
pipeline/. Its rooms, each importing only the ones below it (pyproject.toml's import contract):

    records/   a served request's record (schema.py), the Redis stream it travels on
               (streams.py), the top-k facts both paths share (tokens.py), deleting records
               on request (match.py, deletion.py)
    redis/     the private redis-server (server.py), its per-role ACL users (acl.py), the
               loop's live status hash (loop_status.py)
    grafana/   the Grafana dashboard, generated from code (dashboard.py) beside its JSON
    prompts.py prompt sources: ShareGPT and user JSONL
    registry.py  the draft registry: immutable versions and moving aliases (stable, canary)
    drafts/    the two draft families and their on-disk format: the layer draft (layer.py),
               the head (head.py), their spec and errors (spec.py), the files (files.py)
    target.py  loading the target model and tokenizer from a name, a GGUF file or a folder
    config.py  the one typed config tree
    formats/   what a GGUF file holds, its RoPE scaling, exact 4-bit and 8-bit block codes
    common/    small helpers that import no other room: back-off, durable writes, fault
               points, CPU features, the process reaper, the percentile, canary estimators

A chat record goes serve/engine/capture.py -> records/streams.py -> train/online/trainer.py
-> registry.py -> pipeline/rollout/controller.py."""

from infra.config import ConfigError, OSDConfig, load_config
from infra.target import LoadedModel, TargetError, load_target

__all__ = ["ConfigError", "LoadedModel", "OSDConfig", "TargetError", "load_config", "load_target"]
