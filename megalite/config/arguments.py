"""The full run config, and its command line: flags, then a --config YAML/JSON file underneath them."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megalite.config.flags import add_dataclass_flags, field_types
from megalite.config.model import ModelConfig
from megalite.config.parallel import ParallelConfig
from megalite.config.precision import DDPConfig, PrecisionConfig
from megalite.config.training import CheckpointConfig, LoggingConfig, OptimizerConfig, TrainingConfig
from megalite.data.config import DataConfig

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "precision": PrecisionConfig,
    "ddp": DDPConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}


@dataclass
class MegaliteConfig:
    """Everything a run needs, one dataclass per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> "MegaliteConfig":
        """Build from a flat {field_name: value} mapping (unknown names are an error)."""
        owner = {name: sec for sec, klass in SECTIONS.items() for name in field_types(klass)}
        per_section: dict[str, dict[str, Any]] = {sec: {} for sec in SECTIONS}
        for name, value in values.items():
            key = name.replace("-", "_")
            if key not in owner:
                raise ValueError(f"unknown config field '{name}'")
            per_section[owner[key]][key] = value
        return cls(**{sec: SECTIONS[sec](**kw) for sec, kw in per_section.items()})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Pretrain a GPT with tensor, pipeline and data parallelism.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--config", default=argparse.SUPPRESS,
                        help="YAML or JSON file of flag values (flat, or nested by section); "
                             "flags given on the command line win.")
    for klass in SECTIONS.values():
        add_dataclass_flags(parser, klass)
    return parser


def _load_config_file(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config: file {path} does not exist")
    text = p.read_text()
    if p.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"--config: {path} must hold a mapping of flag names to values")
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            flat.update({k.replace("-", "_"): v for k, v in value.items()})
        else:
            flat[key.replace("-", "_")] = value
    return flat


def parse_args(argv: Sequence[str] | None = None) -> MegaliteConfig:
    """Parse flags (Megatron-LM names) and an optional --config file into a MegaliteConfig."""
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    if "config" in ns:
        try:
            values.update(_load_config_file(ns.pop("config")))
        except ValueError as e:
            parser.error(str(e))
    values.update(ns)
    try:
        return MegaliteConfig.from_flat(values)
    except (TypeError, ValueError) as e:
        parser.error(f"--config: {e}")
        raise
