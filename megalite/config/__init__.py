"""Configs as dataclasses; their fields document and generate the command-line flags.

Names are resolved lazily so that ``megalite.config.flags`` (used by every config dataclass, also the
data package's) can be imported without pulling in the full run config and its dependencies.
"""

from __future__ import annotations

import importlib
from typing import Any

# Eager: the function shadows its submodule's name, and validate.py imports nothing heavy.
from megalite.config.validate import ConfigError as ConfigError
from megalite.config.validate import validate as validate

_EXPORTS = {
    "MegaliteConfig": "megalite.config.arguments", "parse_args": "megalite.config.arguments",
    "ModelConfig": "megalite.config.model", "ParallelConfig": "megalite.config.parallel",
    "LoggingConfig": "megalite.config.training", "OptimizerConfig": "megalite.config.training",
    "TrainingConfig": "megalite.config.training", "CheckpointConfig": "megalite.config.training",
    "PrecisionConfig": "megalite.config.precision", "DDPConfig": "megalite.config.precision",
}

__all__ = sorted([*_EXPORTS, "ConfigError", "validate"])


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megalite.config' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
