"""Learning rate as Megatron's training loop drives megatron-core's OptimizerParamScheduler.

The schedule counts *samples* of successful optimizer steps (Megatron steps its scheduler by the
global batch size after every update that was not skipped by an fp16 overflow). Iteration ``k``
(1-based) applies the rate at ``(k - 1 - skipped) * global_batch`` samples; the rate logged after
iteration ``k`` is the one read back from the optimizer after the scheduler stepped, i.e. the rate at
``(k - skipped) * global_batch`` samples — the rate the *next* iteration will apply. With warm-up the
first iteration therefore applies ``--lr-warmup-init`` (default 0) and ``--lr`` is first applied at
iteration ``warm-up + 1``.

With ``--decoupled-lr`` the input embedding and output layer form their own parameter groups, whose
peak and final rates are ``--decoupled-lr`` and ``--decoupled-min-lr`` (default ``--min-lr``) in the
same schedule: the same warm-up (from the same ``--lr-warmup-init``), decay style and spans, as
megatron-core computes a group's ``max_lr``/``min_lr``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megalite.config.training import OptimizerConfig, TrainingConfig

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


def _wsd_coeff(style: str, ratio: float) -> float:
    """The annealing phase of warm-up/stable/decay: 1 at its start, 0 at its end."""
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, ratio) - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(f"--lr-wsd-decay-style must be one of {', '.join(WSD_DECAY_STYLES)}, got {style}")


@dataclass
class LRSchedule:
    """Rate as a function of scheduler steps (samples). ``warmup_steps`` may be fractional
    (--lr-warmup-fraction x decay steps), as in Megatron."""

    lr: float
    min_lr: float
    warmup_steps: float
    decay_steps: int
    style: str = "cosine"
    init_lr: float = 0.0
    wsd_decay_steps: int | None = None
    wsd_style: str = "exponential"
    decoupled_lr: float | None = None  # peak rate of the embedding and output layer (None: --lr)
    decoupled_min_lr: float | None = None  # their final rate (None: min_lr)

    def at(self, steps: float, decoupled: bool = False) -> float:
        """Learning rate after ``steps`` scheduler steps (samples of successful updates); ``decoupled``:
        the rate of the embedding and output layer (the default rate when there is no --decoupled-lr)."""
        max_lr, min_lr = self.lr, self.min_lr
        if decoupled and self.decoupled_lr is not None:
            max_lr = self.decoupled_lr
            min_lr = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
        if self.warmup_steps > 0 and steps <= self.warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(steps) / float(self.warmup_steps)
        if self.style == "constant":
            return max_lr
        if steps > self.decay_steps:
            return min_lr
        if self.style == "inverse-square-root":
            return max(min_lr, max_lr * max(self.warmup_steps, 1) ** 0.5 / max(steps, 1) ** 0.5)
        ratio = (steps - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.style == "linear":
            coeff = 1.0 - ratio
        elif self.style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        elif self.style == "WSD":
            anneal_start = self.decay_steps - (self.wsd_decay_steps or 0)
            coeff = 1.0 if steps <= anneal_start else _wsd_coeff(
                self.wsd_style, (steps - anneal_start) / self.wsd_decay_steps)
        else:
            raise ValueError(f"--lr-decay-style must be one of {', '.join(DECAY_STYLES)}, got {self.style}")
        return min_lr + coeff * (max_lr - min_lr)

    def after(self, iterations: int, skipped: int, global_batch_size: int, decoupled: bool = False) -> float:
        """The rate once ``iterations`` steps are done, ``skipped`` of them skipped by an fp16 overflow
        (which do not advance the schedule). Before iteration k it is the rate k applies; after it, the
        rate Megatron logs for k (the scheduler has stepped: the next iteration's rate)."""
        return self.at((iterations - skipped) * global_batch_size, decoupled)


def schedule_from_config(o: "OptimizerConfig", t: "TrainingConfig") -> LRSchedule:
    """The schedule in samples, from iteration- or sample-based flags (a validated config, whose
    --global-batch-size and --train-iters are filled in)."""
    gbs = t.global_batch_size
    if t.train_samples is None:
        decay = (o.lr_decay_iters or t.train_iters) * gbs
        wsd = o.lr_wsd_decay_iters * gbs if o.lr_wsd_decay_iters is not None else None
        warmup = o.lr_warmup_iters * gbs
    else:
        decay = o.lr_decay_samples or t.train_samples
        wsd = o.lr_wsd_decay_samples
        warmup = o.lr_warmup_samples
    if o.lr_warmup_fraction is not None:
        warmup = o.lr_warmup_fraction * decay
    return LRSchedule(o.lr, o.min_lr, warmup, decay, o.lr_decay_style, o.lr_warmup_init, wsd,
                      o.lr_wsd_decay_style, o.decoupled_lr, o.decoupled_min_lr)
