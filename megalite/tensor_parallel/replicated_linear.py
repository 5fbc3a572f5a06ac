"""A linear layer whose weight every tensor-parallel rank holds whole.

Multi-latent attention's down-projections (model/mla.py) make a latent that all of a rank's heads read whole,
so they are neither column- nor row-parallel: each rank applies the whole weight to its activation as it comes
(its sequence shard with sequence parallelism, the full sequence without). Without sequence parallelism every
rank sees every token and the gradient arriving at the output is already complete (the up-projections' input
mapping sums it over TP), so the weight gradient is the same on every rank; with it each rank's covers its own
tokens only and is summed over TP before the step (``ShardSpec.partial_grad``), as the norms' are.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.param_meta import declare_param
from megalite.tensor_parallel.sharding import ShardSpec
from megalite.tensor_parallel.weight_grad import linear


class ReplicatedLinear(nn.Module):
    """y = x W^T (no bias), W [out, in] whole on every TP rank; deferrable in a split backward like the others."""

    def __init__(self, in_features: int, out_features: int, ctx: BuildContext, *, init: str = "normal") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty((out_features, in_features), dtype=ctx.dtype, device=ctx.device))
        declare_param(self.weight, ShardSpec(partial_grad=ctx.sequence_parallel), (out_features, in_features), init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)
