"""Column/row-parallel linear layers and the vocab-parallel embedding.

Shapes follow Megatron: activations are [s, b, h] (sequence first), so sequence parallelism splits
dim 0. A layer is built with the run's BuildContext (process groups, sequence parallelism, parameter dtype
and device) and keeps its ProcessGroups; weights are [out, in] as for F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.parallel.groups import Group, ProcessGroups
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.mappings import (
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)
from megalite.tensor_parallel.param_meta import declare_param
from megalite.tensor_parallel.sharding import REPLICATED, ShardSpec, VocabShardSpec
from megalite.tensor_parallel.weight_grad import embedding, linear, weight_grad


def _new_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron's padding: the next multiple of divisible_by x tp."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


class _GatherLinear(torch.autograd.Function):
    """Sequence-parallel input -> all-gather -> GEMM, saving only the local sequence shard for backward
    (the gathered input is gathered again in backward): the activation saving SP exists for. In a split
    backward (``weight_grad.py``) the weight gradient's all-gather and GEMM run in W."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pg: ProcessGroups):
        ctx.pg, ctx.has_bias = pg, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(pg.all_gather(x, Group.TP, dim=0), weight, bias)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        pg = ctx.pg

        def grad_w() -> torch.Tensor:
            full = pg.all_gather(x, Group.TP, dim=0)
            return g.reshape(-1, g.shape[-1]).t().matmul(full.reshape(-1, full.shape[-1]))

        grad_x = pg.reduce_scatter(g.matmul(weight), Group.TP, dim=0)
        grad_b = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, weight_grad(weight, grad_w, g, x), grad_b, None


def linear_gathering_sequence(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              pg: ProcessGroups) -> torch.Tensor:
    """F.linear of the all-gathered sequence-parallel input [s/tp, b, in] -> [s, b, out/tp]."""
    if pg.tp_size == 1:
        return linear(x, weight, bias)
    return _GatherLinear.apply(x, weight, bias, pg)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by rows (output features) over TP ranks.

    input  [s, b, in] full (or [s/tp, b, in] with sequence parallelism, gathered here)
    output [s, b, out/tp], or [s, b, out] with ``gather_output``.
    """

    def __init__(self, in_features: int, out_features: int, ctx: BuildContext, *, bias: bool = True,
                 gather_output: bool = False, spec: ShardSpec | None = None, init: str = "normal") -> None:
        super().__init__()
        pg, dtype, device = ctx.pg, ctx.dtype, ctx.device
        self.pg, self.gather_output, self.sequence_parallel = pg, gather_output, ctx.sequence_parallel
        if out_features % pg.tp_size:
            raise ValueError(f"output features {out_features} not divisible by TP size {pg.tp_size}")
        spec = spec or ShardSpec(dim=0)
        self.weight = _new_param((out_features // pg.tp_size, in_features), dtype, device)
        declare_param(self.weight, spec, (out_features, in_features), init)
        if bias:
            self.bias = _new_param((out_features // pg.tp_size,), dtype, device)
            declare_param(self.bias, spec, (out_features,), "zeros")
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = linear_gathering_sequence(x, self.weight, self.bias, self.pg)
        else:
            y = linear(copy_to_tp(x, self.pg), self.weight, self.bias)
        return gather_from_tp(y, self.pg) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by columns (input features); partial outputs summed over TP.

    input [s, b, in/tp]; output [s, b, out] (or [s/tp, b, out] reduce-scattered with sequence parallelism).
    The bias is replicated and added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, ctx: BuildContext, *, bias: bool = True,
                 init: str = "output") -> None:
        super().__init__()
        pg, dtype, device, sequence_parallel = ctx.pg, ctx.dtype, ctx.device, ctx.sequence_parallel
        self.pg, self.sequence_parallel = pg, sequence_parallel
        if in_features % pg.tp_size:
            raise ValueError(f"input features {in_features} not divisible by TP size {pg.tp_size}")
        self.weight = _new_param((out_features, in_features // pg.tp_size), dtype, device)
        declare_param(self.weight, ShardSpec(dim=1), (out_features, in_features), init)
        if bias:
            self.bias = _new_param((out_features,), dtype, device)
            declare_param(self.bias, ShardSpec(partial_grad=sequence_parallel), (out_features,), "zeros")
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pg.tp_size == 1:  # nothing to reduce: the GEMM adds the bias (one pass less each way)
            return linear(x, self.weight, self.bias)
        y = linear(x, self.weight)
        y = reduce_scatter_to_sp(y, self.pg) if self.sequence_parallel else reduce_from_tp(y, self.pg)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the (padded) vocabulary split by rows over TP ranks.

    Each rank looks up the ids it owns, zeros the others, and the partial results are summed over TP
    (or, with ``reduce_scatter_embeddings``, reduce-scattered along the sequence: Megatron's flag, for sequence
    parallelism when nothing is added to the embedding before the split; the GPT embedding adds learned
    positions first and so scatters itself).
    input [b, s] ids; output [s, b, h].
    """

    def __init__(self, vocab_size: int, padded_vocab: int, hidden: int, ctx: BuildContext, *,
                 reduce_scatter_embeddings: bool = False) -> None:
        super().__init__()
        pg, dtype, device = ctx.pg, ctx.dtype, ctx.device
        self.pg, self.reduce_scatter_embeddings = pg, reduce_scatter_embeddings
        self.vocab_size, self.padded_vocab = vocab_size, padded_vocab
        per_rank = padded_vocab // pg.tp_size
        self.vocab_start = pg.tp_rank * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = _new_param((per_rank, hidden), dtype, device)
        declare_param(self.weight, VocabShardSpec(dim=0, vocab_size=vocab_size, padded_vocab=padded_vocab),
                 (vocab_size, hidden), "normal")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.t()  # [s, b]
        if self.pg.tp_size > 1:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local = (ids - self.vocab_start).masked_fill(outside, 0)
            out = embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            out = embedding(ids, self.weight)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sp(out, self.pg)
        return reduce_from_tp(out, self.pg)


class ReplicatedEmbedding(nn.Embedding):
    """A table every TP rank holds whole (learned positions)."""

    def __init__(self, num: int, dim: int, ctx: BuildContext) -> None:
        super().__init__(num, dim, dtype=ctx.dtype, device=ctx.device)
        declare_param(self.weight, REPLICATED, (num, dim), "normal")
