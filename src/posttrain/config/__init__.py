"""Config models, loading and validation. ``load_config`` is the entry point."""

from posttrain.config.errors import ConfigError, ConfigIssue
from posttrain.config.load import load_config

__all__ = ["ConfigError", "ConfigIssue", "load_config"]
