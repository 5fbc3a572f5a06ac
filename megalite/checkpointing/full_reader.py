"""A checkpoint of any layout read one full (layout-free) tensor at a time, checked against the
parameters its model config says it must hold: megalite's reader of the meeting point (``.full()``, a
full.Full, which every converter and the resharder write from)."""

from __future__ import annotations

from typing import Any

import torch

from megalite.checkpointing.full import Full, OptimizerSource
from megalite.checkpointing.reader import CheckpointError, CheckpointReader
from megalite.checkpointing.stored import all_specs


class FullCheckpoint:
    """Lazily, from mmapped safetensors: ``param(key)`` and ``optim(key, field)`` are full tensors."""

    def __init__(self, load_dir: str, iteration: int | None = None) -> None:
        self.load_dir = load_dir
        self.reader = CheckpointReader(load_dir, iteration)
        self.config: dict[str, Any] = self.reader.config
        self.iteration = self.reader.iteration
        self.state: dict[str, Any] = dict(self.reader.state)
        self.layout: dict[str, Any] = dict(self.reader.meta["layout"])
        self._specs = all_specs(self.config, self.reader.tp)
        saved, expected = set(self.reader.keys()), set(self._specs)
        if saved != expected:
            missing, extra = sorted(expected - saved)[:5], sorted(saved - expected)[:5]
            raise CheckpointError(f"{self.reader.dir}: its parameters do not match its model config "
                                  f"(missing {missing}, unexpected {extra})")

    def keys(self) -> list[str]:
        return list(self._specs)

    def param(self, key: str) -> torch.Tensor:
        return self.reader.full_param(key, self._specs[key])

    def has_optimizer(self) -> bool:
        return self.reader.has_optimizer()

    def optimizer_step(self) -> float:
        return self.reader.optimizer_step()

    def optim(self, key: str, field: str) -> torch.Tensor:
        return self.reader.full_optim(key, field, self._specs[key])

    def params(self) -> dict[str, torch.Tensor]:
        """Every parameter, full (the whole model in memory)."""
        return {k: self.param(k) for k in self.keys()}

    def full(self, with_optimizer: bool = True) -> Full:
        """This checkpoint as the layout-free Full every writer takes (tensors still read lazily); its optimizer
        state when saved and ``with_optimizer``."""
        optimizer = OptimizerSource(self.optim, self.optimizer_step()) if with_optimizer and self.has_optimizer() \
            else None
        return Full(self.config, self.param, self.iteration, self.state, optimizer, self.reader.meta.get("tokenizer"),
                    self.layout)
