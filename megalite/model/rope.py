"""Rotary position embeddings (rotate-half convention, as Megatron's default and HF Llama)."""

from __future__ import annotations

import torch


def rope_frequencies(seq_len: int, rot_dim: int, base: float, device: torch.device | None = None) -> torch.Tensor:
    """Angles [s, rot_dim]: position x inverse frequency, duplicated for the two rotated halves."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    return torch.cat([angles, angles], dim=-1)


def apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate the first angles.shape[-1] channels of x [s, b, heads, d] by angles [s, rot_dim] (the same
    positions in every sample) or [s, b, rot_dim] (each sample's own: positions reset per document)."""
    rot_dim = angles.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    angles = angles[:, None, None, :] if angles.dim() == 2 else angles[:, :, None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    half = rot_dim // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    out = x_rot * cos + rotated * sin
    return torch.cat([out, x_pass], dim=-1) if x_pass.numel() else out
