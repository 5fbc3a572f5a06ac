"""AdamW with weight decay only on matrices (not on biases or norm weights).

Uses apex's FusedAdam when NVIDIA apex is importable on a GPU, else torch's fused (GPU) or foreach
AdamW; all compute the same update.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite import device
from megalite.config.training import OptimizerConfig


def param_groups(modules: list[nn.Module], weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for m in modules:
        for p in m.parameters():
            if not p.requires_grad:
                continue
            (no_decay if p.ndim == 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _apex_fused_adam():
    if not device.has_cuda():
        return None
    try:
        from apex.optimizers import FusedAdam  # NVIDIA apex (built from source), optional
    except ImportError:
        return None
    return FusedAdam


def build_adam(modules: list[nn.Module], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    groups = param_groups(modules, cfg.weight_decay)
    kw = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    fused_apex = _apex_fused_adam()
    if fused_apex is not None:
        return fused_apex(groups, adam_w_mode=True, **kw)
    if device.has_cuda():
        return torch.optim.AdamW(groups, fused=True, **kw)
    return torch.optim.AdamW(groups, foreach=True, **kw)
