"""Configs as dataclasses; their fields document and generate the command-line flags."""

from megalite.config.arguments import MegaliteConfig, parse_args
from megalite.config.model import ModelConfig
from megalite.config.parallel import ParallelConfig
from megalite.config.training import LoggingConfig, OptimizerConfig, TrainingConfig
from megalite.config.validate import ConfigError, validate

__all__ = [
    "ConfigError", "LoggingConfig", "MegaliteConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig",
    "TrainingConfig", "parse_args", "validate",
]
