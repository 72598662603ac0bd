"""The shared plumbing under serving and training: the config tree, target loading, the draft
family and its on-disk format, records and the Redis stream, prompt data, the private Redis,
the draft registry and process clean-up. Imports nothing from serve/, train/ or pipeline/."""

from infra.config import ConfigError, OSDConfig, load_config
from infra.target import LoadedModel, TargetError, load_target

__all__ = ["ConfigError", "LoadedModel", "OSDConfig", "TargetError", "load_config", "load_target"]
