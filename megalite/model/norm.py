"""LayerNorm and RMSNorm with replicated (TP-duplicated) parameters.

Norm weights are identical on every TP rank; with sequence parallelism each rank sees only its
sequence slice, so their gradients are partial and summed over TP (ShardSpec.partial_grad).

With --apply-layernorm-1p (Megatron's zero-centred gamma) the stored weight w starts at 0 and the norm
scales by 1 + w, computed in the weight's dtype as Megatron does (its stated reason: numerical stability;
a weight near 0 keeps more relative precision than one near 1 in bf16/fp16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite import device
from megalite.config.model import ModelConfig
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.param_meta import declare_param
from megalite.tensor_parallel.sharding import ShardSpec


class Norm(nn.Module):
    """The model's norm over the hidden size: --normalization, --norm-epsilon, --apply-layernorm-1p."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, size: int | None = None,
                 partial_grad: bool | None = None) -> None:
        """``size``: the normalized width when it is not --hidden-size (a per-head q/k norm); ``partial_grad``:
        whether each TP rank's gradient is a partial sum (default: with sequence parallelism)."""
        super().__init__()
        kind, hidden, zero_centered = cfg.normalization, size or cfg.hidden_size, cfg.apply_layernorm_1p
        if kind not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"--normalization must be LayerNorm or RMSNorm, got {kind}")
        self.kind, self.eps, self.hidden, self.zero_centered = kind, cfg.norm_epsilon, hidden, zero_centered
        spec = ShardSpec(partial_grad=ctx.sequence_parallel if partial_grad is None else partial_grad)
        init = torch.zeros if zero_centered else torch.ones
        self.weight = nn.Parameter(init(hidden, dtype=ctx.dtype, device=ctx.device))
        declare_param(self.weight, spec, (hidden,), "zeros" if zero_centered else "ones")
        if kind == "LayerNorm":
            self.bias = nn.Parameter(torch.zeros(hidden, dtype=ctx.dtype, device=ctx.device))
            declare_param(self.bias, spec, (hidden,), "zeros")
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered else self.weight
        fused = device.apex_fused_norm(self.kind, x.device.type)  # apex on CUDA when installed
        if self.kind == "LayerNorm":
            if fused is not None:
                return fused(x, weight, self.bias, (self.hidden,), self.eps)
            return F.layer_norm(x, (self.hidden,), weight, self.bias, self.eps)
        if fused is not None:
            return fused(x, weight, (self.hidden,), self.eps)
        return F.rms_norm(x, (self.hidden,), weight, self.eps)
