"""Which gradient elements count in the true global norm: each gradient exactly once.

A replicated parameter's gradient is the same on every TP rank and counts on one of them (its
ShardSpec decides, down to the K/V rows that ranks sharing a GQA group all hold); the last stage's copy
of a tied embedding is not counted again. Squared norms are then summed over the model-parallel group
(and over DP when the optimizer is sharded), so the norm is the same number in every layout.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.parallel.groups import Group, ProcessGroups
from megalite.tensor_parallel.param_meta import param_meta, shard_coords


def counted_ranges(param: nn.Parameter, pg: ProcessGroups, lo: int, hi: int) -> list[tuple[int, int]]:
    """Ranges, relative to ``lo``, of the slice [lo, hi) of ``param``'s flat gradient that count."""
    meta = param_meta(param)
    if meta.tied_embedding and meta.copy_of is not None:  # the output layer's copy (on the loss's stage)
        return []
    out = []
    for s, e in meta.spec.counted_ranges(tuple(param.shape), *shard_coords(meta, pg)):
        s, e = max(s, lo), min(e, hi)
        if s < e:
            out.append((s - lo, e - lo))
    return out


@torch.no_grad()
def global_grad_norm(params: list[nn.Parameter], pg: ProcessGroups) -> float:
    """The global L2 norm of whole-parameter gradients, finalized in their GradBuffer (``main_grad``)."""
    total = torch.zeros((), dtype=torch.float32)
    for p in params:
        flat = p.main_grad.reshape(-1).float().cpu()
        for s, e in counted_ranges(p, pg, 0, flat.numel()):
            total += flat[s:e].square().sum()
    total = total.to(next(iter(params)).device) if params else total
    pg.all_reduce(total, Group.MP)
    return float(total.sqrt())
