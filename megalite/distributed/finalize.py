"""Make every rank's gradients final before the optimizer step.

1. DP: wait for (or launch) every bucket's reduction of the gradient buffers.
2. TP: sum partial gradients of replicated parameters (K/V copies shared by ranks, sequence-parallel
   norms); each ShardSpec knows its rule.
3. PP: sum the tied embedding's gradient over the embedding group (first and last stage), or on the rank
   when it holds both (ZB-V's V puts the first and the last stage on the first rank).
The three are sums over different groups, so their order does not change the result; with the
distributed optimizer only this rank's shard is final, which is all it reads. With sharded gradients
(ZeRO-2/3) the TP sums ran per micro-batch before the reduce-scatter (they need whole gradients), and
the tied embedding's sum runs on this rank's shard (both copies shard identically).
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.distributed.grad_buffer import GradBuffer
from megalite.parallel.groups import Group, ProcessGroups
from megalite.tensor_parallel.param_meta import param_meta


def tied_embedding_params(modules: list[nn.Module]) -> list[nn.Parameter]:
    """The tied word-embedding weight on the first stage and its copy on the last one (PP > 1)."""
    return [p for m in modules for p in m.parameters() if param_meta(p).tied_embedding]


@torch.no_grad()
def finalize_grads(modules: list[nn.Module], buffers: list[GradBuffer], pg: ProcessGroups) -> None:
    for b in buffers:
        b.finish_grad_sync()
    owner = {p: b for b in buffers for p in b.ranges}
    for m in modules:
        for p in m.parameters():
            if p in owner and not owner[p].shard_grads:
                param_meta(p).spec.finalize_grad(p.main_grad, pg)
    tied = tied_embedding_params(modules)
    slices = []
    for p in tied:
        buf = owner[p]
        region = buf.owned_region(p) if buf.shard_grads else (0, p.numel())
        if region is not None:
            slices.append(buf.grad_slice(p, *region))
    if len(tied) == 2:  # both copies on this rank (ZB-V's first rank holds the first and the last stage)
        if slices:
            total = slices[0] + slices[1]
            for s in slices:
                s.copy_(total)
    elif pg.pp_size > 1:
        for s in slices:
            pg.all_reduce(s, Group.EMBD)
