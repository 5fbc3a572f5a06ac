"""``validate`` with the place each file-set value was written: a value that came from a --config file or a
DeepSpeed JSON key is reported with the key (and line) the user wrote, not only the flag it became.

``parse_args`` records ``cfg.written`` ({field name: "'zero_optimization.stage' in ds.json"}) for the
values the command line did not set (a module apart: validate's MoE rules import the arguments module).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megalite.config.file_values import name_written
from megalite.config.validate import ConfigError, validate

if TYPE_CHECKING:
    from megalite.config.arguments import MegaliteConfig


def validate_as_written(cfg: "MegaliteConfig", world_size: int, local_world_size: int | None = None) -> None:
    """``validate``, its ConfigError naming the file key and line of every value that came from a file."""
    try:
        validate(cfg, world_size, local_world_size)
    except ConfigError as e:
        raise ConfigError(name_written(str(e), getattr(cfg, "written", {}))) from None
