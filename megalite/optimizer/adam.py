"""AdamW (decoupled weight decay) on the fp32 main params: which implementation runs.

On a GPU: NVIDIA apex's FusedAdam when the real apex is importable (megalite/device.py), else
torch's fused AdamW. Elsewhere (CPU, or main params offloaded to the host): torch's foreach AdamW, the
tested fallback. All compute the same update; tests/test_fused_kernels.py checks fused against foreach.
"""

from __future__ import annotations

from typing import Any

import torch

from megalite import device


def _apex_adamw(fused_adam: type) -> type:
    """apex FusedAdam keeping torch's per-parameter ``state['step']`` (checkpoints save and restore it;
    apex itself counts steps per group)."""

    class ApexAdamW(fused_adam):
        def step(self, closure=None):
            for group in self.param_groups:
                restored = [self.state[p]["step"] for p in group["params"] if "step" in self.state.get(p, {})]
                if restored:
                    group["step"] = int(restored[0])
            out = super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    if p in self.state:
                        self.state[p]["step"] = torch.tensor(float(group["step"]))
            return out

    return ApexAdamW


def build_adamw(groups: list[dict[str, Any]], *, on_gpu: bool, lr: float, betas: tuple[float, float],
                eps: float) -> torch.optim.Optimizer:
    """AdamW over ``groups`` (each with its weight_decay); ``on_gpu``: the main params live on a GPU."""
    if on_gpu:
        fused_adam = device.apex_fused_adam_class()
        if fused_adam is not None:
            return _apex_adamw(fused_adam)(groups, adam_w_mode=True, lr=lr, betas=betas, eps=eps)
        return torch.optim.AdamW(groups, fused=True, lr=lr, betas=betas, eps=eps)
    return torch.optim.AdamW(groups, foreach=True, lr=lr, betas=betas, eps=eps)
