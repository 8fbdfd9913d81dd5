"""Config models, loading and validation. ``load_config`` is the entry point."""

from posttrain.config.errors import ConfigError, ConfigIssue


def load_config(*args, **kwargs):  # type: ignore[no-untyped-def]
    """Load, override, resolve and validate a config (see ``posttrain.config.load.load_config``)."""
    from posttrain.builtins import register_builtins
    from posttrain.config.load import load_config as _load

    register_builtins()
    return _load(*args, **kwargs)


__all__ = ["ConfigError", "ConfigIssue", "load_config"]
