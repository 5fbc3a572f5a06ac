"""Make every rank's gradients final before the optimizer step.

1. TP: sum partial gradients of replicated parameters (K/V copies shared by ranks, sequence-parallel
   norms) — each ShardSpec knows its rule.
2. PP: sum the tied embedding's gradient over the embedding group (first and last stage).
3. DP: average gradients over data-parallel ranks, one coalesced all-reduce of the gradient buffer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from megalite.parallel.groups import ProcessGroups


def tied_embedding_params(modules: Iterable[nn.Module], pg: ProcessGroups) -> list[nn.Parameter]:
    """The tied word-embedding weight on the first stage and its copy on the last one."""
    return [p for m in modules for p in m.parameters() if getattr(p, "tied_embedding_copy", False)]


def all_reduce_coalesced(tensors: list[torch.Tensor], pg: ProcessGroups, kind: str, scale: float = 1.0) -> None:
    """All-reduce a list of tensors as one flat buffer, then scale."""
    if not tensors or pg.size(kind) == 1:
        if scale != 1.0:
            for t in tensors:
                t.mul_(scale)
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    pg.all_reduce(flat, kind)
    if scale != 1.0:
        flat.mul_(scale)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset: offset + n].view_as(t))
        offset += n


@torch.no_grad()
def finalize_grads(modules: list[nn.Module], pg: ProcessGroups, reduce_dp: bool = True) -> None:
    params = [p for m in modules for p in m.parameters() if p.grad is not None]
    for p in params:
        p.shard_spec.finalize_grad(p.grad, pg)
    if pg.pp_size > 1:
        tied = [p.grad for p in tied_embedding_params(modules, pg) if p.grad is not None]
        all_reduce_coalesced(tied, pg, "embd")
    if reduce_dp:
        all_reduce_coalesced([p.grad for p in params], pg, "dp", scale=1.0 / pg.dp_size)
