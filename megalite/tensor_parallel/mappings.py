"""Autograd communication pairs: each op's backward is its forward's dual.

copy_to_tp      forward identity        backward all-reduce       (entering a column-parallel GEMM)
reduce_from_tp  forward all-reduce      backward identity         (leaving a row-parallel GEMM)
gather_from_tp  forward all-gather      backward split last dim   (a column-parallel output gathered)
With sequence parallelism (activations split along dim 0, the sequence):
scatter_to_sp   forward split dim 0     backward all-gather
reduce_scatter_to_sp forward reduce-scatter backward all-gather   (after a row-parallel GEMM)
gather_from_sp  forward all-gather      backward reduce-scatter   (a replicated activation every rank's heads read
                                                                   whole: multi-latent attention's RoPE key)
The all-gather before a column-parallel GEMM is not here: layers.linear_gathering_sequence does it
inside the GEMM's own autograd function, so the gathered input is not kept for backward.
"""

from __future__ import annotations

import torch

from megalite.parallel.groups import Group, ProcessGroups


def _split(x: torch.Tensor, pg: ProcessGroups, dim: int) -> torch.Tensor:
    if pg.tp_size == 1:
        return x
    return x.chunk(pg.tp_size, dim=dim)[pg.tp_rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x

    @staticmethod
    def backward(ctx, g):
        return ctx.pg.all_reduce(g.clone(memory_format=torch.contiguous_format), Group.TP), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        return pg.all_reduce(x.clone(memory_format=torch.contiguous_format), Group.TP)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg, dim):
        ctx.pg, ctx.dim = pg, dim
        return _split(x, pg, dim)

    @staticmethod
    def backward(ctx, g):
        return ctx.pg.all_gather(g, Group.TP, dim=ctx.dim), None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg, dim):
        ctx.pg, ctx.dim = pg, dim
        return pg.all_gather(x, Group.TP, dim=dim)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.pg, ctx.dim), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return pg.all_gather(x.contiguous(), Group.TP, dim=0)

    @staticmethod
    def backward(ctx, g):
        return ctx.pg.reduce_scatter(g.contiguous(), Group.TP, dim=0), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return pg.reduce_scatter(x.contiguous(), Group.TP, dim=0)

    @staticmethod
    def backward(ctx, g):
        return ctx.pg.all_gather(g, Group.TP, dim=0), None


def copy_to_tp(x: torch.Tensor, pg: ProcessGroups) -> torch.Tensor:
    return _CopyToTP.apply(x, pg) if pg.tp_size > 1 else x


def reduce_from_tp(x: torch.Tensor, pg: ProcessGroups) -> torch.Tensor:
    return _ReduceFromTP.apply(x, pg) if pg.tp_size > 1 else x


def gather_from_tp(x: torch.Tensor, pg: ProcessGroups, dim: int = -1) -> torch.Tensor:
    return _GatherFromTP.apply(x, pg, dim) if pg.tp_size > 1 else x


def scatter_to_sp(x: torch.Tensor, pg: ProcessGroups) -> torch.Tensor:
    return _ScatterToTP.apply(x, pg, 0) if pg.tp_size > 1 else x


def reduce_scatter_to_sp(x: torch.Tensor, pg: ProcessGroups) -> torch.Tensor:
    return _ReduceScatterToSP.apply(x, pg) if pg.tp_size > 1 else x


def gather_from_sp(x: torch.Tensor, pg: ProcessGroups) -> torch.Tensor:
    """The whole sequence of a sequence-parallel activation [s/tp, ...] -> [s, ...]; each rank's gradient is a
    partial sum (its heads' part), reduce-scattered back to the shards."""
    return _GatherFromSP.apply(x, pg) if pg.tp_size > 1 else x
