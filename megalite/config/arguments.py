"""The full run config, and its command line: flags, then a --config YAML/JSON file underneath them."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from megalite.config.data import DataConfig
from megalite.config.deepspeed import BATCH_KEY_OF, DeepSpeedMapping, load_deepspeed_config, resolve_batch
from megalite.config.deepspeed import refusal as ds_refusal
from megalite.config.file_values import ConfigFileError, did_you_mean, load_config_file, name_written
from megalite.config.flags import add_dataclass_flags, field_specs, field_types
from megalite.config.megatron_compat import add_compat_flags, pop_compat_flags, refusal, warn_ignored
from megalite.config.model import ModelConfig
from megalite.config.parallel import ParallelConfig
from megalite.config.precision import DDPConfig, PrecisionConfig
from megalite.config.training import CheckpointConfig, LoggingConfig, OptimizerConfig, TrainingConfig

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
    # Where the values a file set were written ({field name: "'key' in file, line N"}), for messages; set
    # per instance by parse_args. Not a field: the checkpoint records values, not where they came from.
    written: ClassVar[dict[str, str]] = {}

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
        usage="%(prog)s [--help] [--config FILE] [--FLAG VALUE ...]",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--config", default=argparse.SUPPRESS,
                        help="YAML or JSON file of flag values (flat, or nested by section); "
                             "flags given on the command line win.")
    parser.add_argument("--deepspeed-config", "--deepspeed_config", dest="deepspeed_config",
                        default=argparse.SUPPRESS, metavar="DS_CONFIG_JSON",
                        help="A DeepSpeed ds_config.json: its keys become megalite flags (the mapping is printed "
                             "at start-up; keys megalite cannot honour are named); --config and command-line "
                             "flags win over it. See docs/training.md.")
    for klass in SECTIONS.values():
        add_dataclass_flags(parser, klass)
    add_compat_flags(parser)
    return parser


def _file_fields() -> dict[str, tuple[Any, bool, list | None, bool]]:
    return {name: spec for klass in SECTIONS.values() for name, spec in field_specs(klass).items()}


def _reject_unknown(parser: argparse.ArgumentParser, unknown: list[str]) -> None:
    """argparse's 'unrecognized arguments' error, with the closest known flag suggested."""
    flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    named = [u for u in unknown if u.startswith("-")]
    if not named:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    parser.error("; ".join(f"unrecognized argument {u.split('=')[0]}{did_you_mean(u.split('=')[0], flags)}"
                           for u in named))


def parse_args(argv: Sequence[str] | None = None) -> MegaliteConfig:
    """Parse flags (Megatron-LM names) and an optional --config file into a MegaliteConfig. Every
    error (unknown flag, unreadable file, mistyped value) exits through ``parser.error``: status 2,
    one message naming the flag, key, file or line."""
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        _reject_unknown(parser, unknown)
    ns = vars(ns)
    ignored, refused = pop_compat_flags(ns)
    if refused:
        parser.error(refusal(refused))
    values: dict[str, Any] = {}
    written: dict[str, str] = {}  # what a file set, and where: the command line's values are its own
    command_line = set(ns) - {"config", "deepspeed_config"}
    ds: DeepSpeedMapping | None = None
    try:
        if "deepspeed_config" in ns:
            ds = load_deepspeed_config(ns.pop("deepspeed_config"))
            values.update(ds.values)
            written.update(ds.written)
        if "config" in ns:
            from_file = load_config_file(ns.pop("config"), SECTIONS, _file_fields())
            values.update(from_file.values)
            written.update(from_file.written)
            ns = {**from_file.values, **ns}  # --config and command-line values both win over the DeepSpeed file
    except ConfigFileError as e:
        parser.error(str(e))
    values.update(ns)
    try:
        cfg = MegaliteConfig.from_flat(values)
        if ds is not None:
            _apply_deepspeed_batch(cfg, ds, set(ns))
            written = {**ds.written, **written}  # the batch keys, resolved only now
            if ds_refusal(ds):
                parser.error(ds_refusal(ds))
    except (TypeError, ValueError) as e:
        parser.error(name_written(f"--config: {e}", written))
        raise
    cfg.written = {k: v for k, v in written.items() if k not in command_line}
    warn_ignored(parser.prog, ignored)
    return cfg


def _apply_deepspeed_batch(cfg: MegaliteConfig, ds: DeepSpeedMapping, given: set[str]) -> None:
    """DeepSpeed's batch keys, resolved with this launch's data-parallel size (WORLD_SIZE over TP x PP x CP);
    then the mapping is printed (rank 0)."""
    p = cfg.parallel
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    dp = max(world // model_parallel, 1) if model_parallel > 0 else 1  # sizes out of domain: validate names them
    try:
        for name, value in resolve_batch(ds, dp).items():
            if name not in given:
                setattr(cfg.training, name, value)
                ds.written[name] = f"'{BATCH_KEY_OF[name]}' in {ds.path}"
    except ConfigFileError as e:
        ds.refuse("batch size", str(e))
    if os.environ.get("RANK", "0") == "0":
        print(ds.report(given), flush=True)
