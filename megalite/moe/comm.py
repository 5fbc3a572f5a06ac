"""Differentiable collectives of token dispatch, on any ProcessGroups kind (each backward is its dual)."""

from __future__ import annotations

import torch

from megalite.parallel.groups import ProcessGroups


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, pg: ProcessGroups, kind: str, out_splits: list[int], in_splits: list[int],
                label: str) -> torch.Tensor:
        ctx.args = (pg, kind, in_splits, out_splits, label)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        pg.all_to_all_v(out, x, out_splits, in_splits, kind, label)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        pg, kind, out_splits, in_splits, label = ctx.args
        out = g.new_empty((sum(out_splits), *g.shape[1:]))
        pg.all_to_all_v(out, g.contiguous(), out_splits, in_splits, kind, label)
        return out, None, None, None, None, None


def all_to_all_v(x: torch.Tensor, pg: ProcessGroups, kind: str, out_splits: list[int], in_splits: list[int],
                 label: str = "moe_all_to_all") -> torch.Tensor:
    """Rows of ``x`` cut by ``in_splits`` go to the group's ranks in order; ``out_splits`` rows come back from
    each. Backward sends the gradients the reverse way."""
    if pg.size(kind) == 1:
        return x
    return _AllToAllV.apply(x, pg, kind, list(out_splits), list(in_splits), label)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, pg: ProcessGroups, kind: str, label: str) -> torch.Tensor:
        ctx.args = (pg, kind, label)
        out = x.new_empty((pg.size(kind) * x.shape[0], *x.shape[1:]))
        pg.all_gather_flat(out, x, kind, label=label)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        pg, kind, label = ctx.args
        n = pg.size(kind)
        out = g.new_empty((g.shape[0] // n, *g.shape[1:]))
        pg.reduce_scatter_flat(out, g.contiguous(), kind, label=label)
        return out, None, None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, pg: ProcessGroups, kind: str, label: str) -> torch.Tensor:
        ctx.args = (pg, kind, label)
        out = x.new_empty((x.shape[0] // pg.size(kind), *x.shape[1:]))
        pg.reduce_scatter_flat(out, x.contiguous(), kind, label=label)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        pg, kind, label = ctx.args
        out = g.new_empty((pg.size(kind) * g.shape[0], *g.shape[1:]))
        pg.all_gather_flat(out, g.contiguous(), kind, label=label)
        return out, None, None, None


def gather_rows(x: torch.Tensor, pg: ProcessGroups, kind: str, label: str = "moe_all_gather") -> torch.Tensor:
    """Every rank's equal-sized ``x`` stacked along dim 0 in group order (backward: reduce-scatter)."""
    return x if pg.size(kind) == 1 else _GatherRows.apply(x, pg, kind, label)


def reduce_scatter_rows(x: torch.Tensor, pg: ProcessGroups, kind: str, label: str = "moe_reduce_scatter"
                        ) -> torch.Tensor:
    """Sum over the group, keep this rank's 1/n of the rows (backward: all-gather)."""
    return x if pg.size(kind) == 1 else _ReduceScatterRows.apply(x, pg, kind, label)


def gather_rows_nograd(x: torch.Tensor, pg: ProcessGroups, kind: str) -> torch.Tensor:
    """``gather_rows`` for integer and mask tensors (routing decisions), not counted as token traffic."""
    if pg.size(kind) == 1:
        return x
    out = x.new_empty((pg.size(kind) * x.shape[0], *x.shape[1:]))
    pg.all_gather_flat(out, x.contiguous(), kind, label="moe_routing_all_gather")
    return out
