"""Rotary position embeddings (rotate-half convention, as Megatron's default and HF Llama)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3's frequency-dependent RoPE scaling (--use-rope-scaling and its factors)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_context: int

    @classmethod
    def of(cls, cfg: Any) -> "Llama3Scaling | None":
        """The scaling a ModelConfig asks for, or None."""
        if not cfg.use_rope_scaling:
            return None
        return cls(cfg.rope_scaling_factor, cfg.rope_scaling_low_freq_factor, cfg.rope_scaling_high_freq_factor,
                   cfg.rope_scaling_original_max_position_embeddings)

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Frequencies whose wavelength exceeds original / low_freq_factor are divided by ``factor`` (the model
        never saw a full turn of them), those below original / high_freq_factor kept, and the band between
        interpolated linearly in original / wavelength (Megatron's and transformers' 'llama3' rule)."""
        wavelen = 2 * math.pi / inv_freq
        low, high = self.low_freq_factor, self.high_freq_factor
        scaled = torch.where(wavelen > self.original_context / low, inv_freq / self.factor, inv_freq)
        smooth = (self.original_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= self.original_context / high) & (wavelen <= self.original_context / low)
        return torch.where(medium, smoothed, scaled)


@dataclass(frozen=True)
class YarnScaling:
    """YaRN's frequencies (--position-embedding-type yarn; config/yarn.py has its flags, its concentration
    factor and softmax-scale multiplier)."""

    factor: float
    original_context: int
    beta_fast: float
    beta_slow: float
    round_to_int: bool
    base: float

    @classmethod
    def of(cls, cfg: Any) -> "YarnScaling | None":
        if cfg.position_embedding_type != "yarn":
            return None
        return cls(cfg.rotary_scaling_factor, cfg.yarn_original_max_position_embeddings, cfg.yarn_beta_fast,
                   cfg.yarn_beta_slow, cfg.yarn_correction_range_round_to_int, cfg.rotary_base)

    def _correction_dim(self, turns: float, dim: int) -> float:
        """The dimension whose frequency turns ``turns`` times over the original context."""
        return dim * math.log(self.original_context / (turns * 2 * math.pi)) / (2 * math.log(self.base))

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Each frequency blended from its original value (kept below the fast correction dimension) to
        it divided by ``factor`` (past the slow one) along a linear ramp, as megatron-core and transformers."""
        dim = 2 * inv_freq.shape[0]
        low, high = self._correction_dim(self.beta_fast, dim), self._correction_dim(self.beta_slow, dim)
        if self.round_to_int:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as both do: no division by zero
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
        kept = 1 - ramp
        pos = self.base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=inv_freq.device) / dim)
        return 1.0 / (self.factor * pos) * (1 - kept) + inv_freq * kept


def rope_scaling(cfg: Any) -> Llama3Scaling | YarnScaling | None:
    """The frequency scaling a ModelConfig asks for (--use-rope-scaling or YaRN), or None."""
    return YarnScaling.of(cfg) or Llama3Scaling.of(cfg)


def rope_frequencies(seq_len: int, rot_dim: int, base: float, device: torch.device | None = None,
                     scaling: Llama3Scaling | YarnScaling | None = None,
                     linear_factor: float | None = None) -> torch.Tensor:
    """Angles [s, rot_dim]: position x inverse frequency (scaled by ``scaling``, if any, or divided by
    ``linear_factor``: --rotary-seq-len-interpolation-factor, transformers' 'linear'), duplicated for the two
    rotated halves."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim))
    if scaling is not None:
        inv_freq = scaling.apply(inv_freq)
    if linear_factor is not None:
        inv_freq = inv_freq / linear_factor
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    return torch.cat([angles, angles], dim=-1)


@dataclass(frozen=True)
class KindAngles:
    """The angles of the full-attention layers and of the windowed ones when their bases differ
    (--rotary-base-local), passed down the layers as one value; each attention picks its own."""

    full: torch.Tensor
    local: torch.Tensor

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "KindAngles":
        return KindAngles(fn(self.full), fn(self.local))


def layer_angles(angles: "torch.Tensor | KindAngles | None", window: int) -> torch.Tensor | None:
    """The angles of a layer whose window is ``window`` (0: full attention)."""
    if isinstance(angles, KindAngles):
        return angles.local if window else angles.full
    return angles


def apply_rope(x: torch.Tensor, angles: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Rotate the first angles.shape[-1] channels of x [s, b, heads, d] by angles [s, rot_dim] (the same
    positions in every sample) or [s, b, rot_dim] (each sample's own: positions reset per document); cos and
    sin multiplied by ``scale`` first (YaRN's concentration factor, ModelConfig.rope_attention_factor)."""
    rot_dim = angles.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    angles = angles[:, None, None, :] if angles.dim() == 2 else angles[:, :, None, :]
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = rot_dim // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    out = x_rot * cos + rotated * sin
    return torch.cat([out, x_pass], dim=-1) if x_pass.numel() else out
