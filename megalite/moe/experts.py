"""The routed experts of one MoE layer on this rank: E/ep experts, each hidden size split over expert-TP.

Weights are stacked per expert as Hugging Face's Mixtral/Qwen-MoE store them: fc1 [E, 2F, h] ([gate; up]
with SwiGLU, else [E, F, h]) and fc2 [E, h, F]; this rank holds its experts' rows of dim 0 and its
expert-TP slice of F. The local experts run one after the other (the reference) or in one grouped GEMM
(--moe-grouped-gemm, where this torch runs a grouped GEMM on the device and dtype: megalite.compat).
"""

from __future__ import annotations

import torch
from torch import nn

from megalite import compat
from megalite.config.model import ModelConfig
from megalite.parallel.groups import Group
from megalite.tensor_parallel.activations import mlp_activation
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.param_meta import EXPERT, amend_param, declare_param
from megalite.tensor_parallel.sharding import ShardSpec
from megalite.tensor_parallel.weight_grad import experts_linear


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped_mm's backward needs it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g.contiguous()


def _grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The grouped GEMM needs row strides (both feature sizes, in bytes) that are multiples of 16."""
    return all(n * x.element_size() % 16 == 0 for n in (x.shape[1], weight.shape[1]))


def _grouped_fits(x: torch.Tensor, weight: torch.Tensor, grouped: bool) -> bool:
    """Whether the grouped GEMM runs here: rows to multiply, a torch and device that have it, sizes it takes."""
    return grouped and x.shape[0] > 0 and compat.grouped_mm_supported(x.device.type, x.dtype) \
        and _grouped_mm_fits(x, weight)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int], grouped: bool) -> torch.Tensor:
    """Rows of ``x`` [n, in], consecutive blocks of ``counts`` rows, each times its expert's ``weight[e]``
    [out, in] transposed: [n, out]. Grouped where possible, else (no rows, sizes it refuses, a torch without it) the
    loop. In a split backward (``tensor_parallel/weight_grad.py``) F and B keep the grouped GEMM where it runs
    and only the weight gradient, deferred to W, loops over the experts."""
    fits = _grouped_fits(x, weight, grouped)
    deferrable = experts_linear(x, weight, counts, compat.grouped_mm if fits else None)
    if deferrable is not None:
        return deferrable
    if fits:
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return _ContiguousGrad.apply(compat.grouped_mm(x, weight.transpose(1, 2), offs))
    parts = x.split(counts)
    # unbind, not weight[e]: indexing's backward would write a zero gradient of the whole stack per expert
    per_expert = weight.unbind(0)
    return torch.cat([p @ per_expert[e].t() for e, p in enumerate(parts)]) if parts \
        else x.new_zeros((0, weight.shape[1]))


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: BuildContext) -> None:
        super().__init__()
        E, h, ffn = cfg.num_experts, cfg.hidden_size, cfg.expert_ffn_hidden_size
        etp, local = ctx.pg.size(Group.ETP), cfg.num_experts // ctx.pg.size(Group.EP)
        dtype, device = ctx.dtype, ctx.device
        self.cfg, self.grouped = cfg, cfg.moe_grouped_gemm
        rows = 2 * ffn if cfg.gated_linear_unit else ffn
        self.fc1_weight = nn.Parameter(torch.empty((local, rows // etp, h), dtype=dtype, device=device))
        declare_param(self.fc1_weight, ShardSpec(dim=1, chunks=2 if cfg.gated_linear_unit else 1), (E, rows, h),
                      "normal")
        self.fc2_weight = nn.Parameter(torch.empty((local, h, ffn // etp), dtype=dtype, device=device))
        declare_param(self.fc2_weight, ShardSpec(dim=2), (E, h, ffn), "output")
        for p in (self.fc1_weight, self.fc2_weight):
            amend_param(p, family=EXPERT)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x`` [n, h] sorted by local expert, ``counts`` rows each: [n, h] (partial sums over expert-TP)."""
        h = mlp_activation(grouped_linear(x, self.fc1_weight, counts, self.grouped), self.cfg)
        return grouped_linear(h, self.fc2_weight, counts, self.grouped)
