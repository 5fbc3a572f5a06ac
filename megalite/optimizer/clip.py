"""The true global gradient norm, counting each gradient exactly once, and clipping by it.

A replicated parameter's gradient is the same on every TP rank and counts on one of them (its
ShardSpec decides); the last stage's copy of a tied embedding is not counted again; the squared norms
are summed over the model-parallel (TP x PP) group. So the norm is the same number in every layout.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.parallel.groups import ProcessGroups


@torch.no_grad()
def global_grad_norm(params: list[nn.Parameter], pg: ProcessGroups) -> float:
    device = params[0].device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if p.grad is None or getattr(p, "tied_embedding_copy", False) and not pg.is_first_stage:
            continue
        total += p.shard_spec.grad_sq_norm(p.grad, pg.tp_rank, pg.tp_size)
    pg.all_reduce(total, "mp")
    return float(total.sqrt())


@torch.no_grad()
def clip_grads(params: list[nn.Parameter], max_norm: float, norm: float) -> None:
    """Scale gradients so their global norm is at most ``max_norm`` (given the computed ``norm``)."""
    if max_norm <= 0 or norm <= max_norm or not torch.isfinite(torch.tensor(norm)):
        return
    coeff = max_norm / (norm + 1e-6)
    grads = [p.grad for p in params if p.grad is not None]
    torch._foreach_mul_(grads, coeff)
