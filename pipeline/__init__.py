"""What the rest shares: the config tree, target loading, prompt data and the `osd` CLI."""

from pipeline.config import ConfigError, OSDConfig, load_config
from pipeline.target import LoadedModel, TargetError, load_target

__all__ = ["ConfigError", "LoadedModel", "OSDConfig", "TargetError", "load_config", "load_target"]
