"""Typed configuration for hyflow: dataclass schemas, YAML files and ``key=value`` overrides."""
from hyflow.config.core import (
    ConfigError,
    apply_overrides,
    config_keys,
    dump_yaml,
    format_config,
    from_dict,
    load_config,
    to_dict,
)
from hyflow.config.describe import describe, format_changes

__all__ = [
    "ConfigError", "apply_overrides", "config_keys", "describe", "dump_yaml", "format_changes", "format_config",
    "from_dict", "load_config", "to_dict",
]
