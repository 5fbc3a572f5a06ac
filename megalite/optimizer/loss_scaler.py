"""fp16 loss scaling: a constant scale, or Megatron's dynamic scaler.

Dynamic: start at --initial-loss-scale (2^32); after --loss-scale-window clean steps in a row, double;
an overflowing step is skipped, and after --hysteresis overflows the scale halves (never below
--min-loss-scale). A scale stuck at its minimum while steps keep overflowing is reported, not hidden.
"""

from __future__ import annotations

from dataclasses import dataclass


class LossScaleCollapse(RuntimeError):
    """fp16 training cannot make progress: gradients overflow even at the minimum loss scale."""


@dataclass
class DynamicLossScaler:
    scale: float = 2.0**32
    min_scale: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    collapse_iters: int = 20
    growth: float = 2.0
    backoff: float = 0.5

    def __post_init__(self) -> None:
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis
        self.overflows_at_min = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            at_min = self.scale <= self.min_scale
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
            self.overflows_at_min = self.overflows_at_min + 1 if at_min else 0
            if self.overflows_at_min >= self.collapse_iters:
                raise LossScaleCollapse(
                    f"fp16 loss scale collapsed: {self.overflows_at_min} consecutive iterations overflowed with the "
                    f"loss scale at --min-loss-scale ({self.min_scale}); every step is being skipped. Lower the "
                    "learning rate, use --bf16, or check the data for bad samples.")
            return
        self.overflows_at_min = 0
        self.growth_tracker += 1
        if self.growth_tracker == self.window:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= self.growth

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker, "overflows_at_min": self.overflows_at_min}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


@dataclass
class ConstantLossScaler:
    scale: float = 1.0

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
