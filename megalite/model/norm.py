"""LayerNorm and RMSNorm with replicated (TP-duplicated) parameters.

Norm weights are identical on every TP rank; with sequence parallelism each rank sees only its
sequence slice, so their gradients are partial and summed over TP (ShardSpec.partial_grad).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite import device
from megalite.tensor_parallel.param_meta import declare_param
from megalite.tensor_parallel.sharding import ShardSpec


class Norm(nn.Module):
    def __init__(self, hidden: int, kind: str, eps: float, sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> None:
        super().__init__()
        if kind not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"--normalization must be LayerNorm or RMSNorm, got {kind}")
        self.kind, self.eps, self.hidden = kind, eps, hidden
        spec = ShardSpec(partial_grad=sequence_parallel)
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))
        declare_param(self.weight, spec, (hidden,), "ones")
        if kind == "LayerNorm":
            self.bias = nn.Parameter(torch.zeros(hidden, dtype=dtype, device=device))
            declare_param(self.bias, spec, (hidden,), "zeros")
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = device.apex_fused_norm(self.kind, x.device.type)  # apex on CUDA when installed
        if self.kind == "LayerNorm":
            if fused is not None:
                return fused(x, self.weight, self.bias, (self.hidden,), self.eps)
            return F.layer_norm(x, (self.hidden,), self.weight, self.bias, self.eps)
        if fused is not None:
            return fused(x, self.weight, (self.hidden,), self.eps)
        return F.rms_norm(x, (self.hidden,), self.weight, self.eps)
