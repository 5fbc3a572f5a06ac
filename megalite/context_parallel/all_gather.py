"""Gathered-K/V attention (``--cp-comm-type allgather``): every rank gathers all keys and values over CP
and keeps its own queries; the mask comes from the global positions (causal and, given, per document).
The backward reduce-scatters dK/dV: every rank's rows contribute to every key, each owner keeps the sum
of its own chunk's part."""

from __future__ import annotations

import torch

from megalite import compat
from megalite.context_parallel import blockwise
from megalite.context_parallel.zigzag import zigzag_positions
from megalite.parallel.groups import Group, ProcessGroups


class _GatherKV(torch.autograd.Function):
    """[2, b, g, s/c, d] -> [c, 2, b, g, s/c, d] (every rank's K/V in rank order); backward reduce-scatter."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor, pg: ProcessGroups) -> torch.Tensor:
        ctx.pg = pg
        out = torch.empty((pg.size(Group.CP), *kv.shape), dtype=kv.dtype, device=kv.device)
        pg.all_gather_flat(out.view(-1), kv.reshape(-1), Group.CP, label="all_gather kv")
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = torch.empty(grad.shape[1:], dtype=grad.dtype, device=grad.device)
        ctx.pg.reduce_scatter_flat(out.view(-1), grad.reshape(-1), Group.CP, label="reduce_scatter dkv")
        return out, None


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pg: ProcessGroups,
                         segment_ids: torch.Tensor | None, dropout_p: float) -> torch.Tensor:
    c, r = pg.size(Group.CP), pg.index(Group.CP)
    b, g, s_local, d = k.shape
    kv = _GatherKV.apply(torch.stack([k, v]), pg)  # [c, 2, b, g, s_local, d]
    kv = kv.permute(1, 2, 3, 0, 4, 5).reshape(2, b, g, c * s_local, d)  # keys in the ranks' zigzag order
    pos = zigzag_positions(s_local, c, q.device)
    mask = blockwise.allowed(pos[r], pos.flatten(), segment_ids, causal=True)[:, :, 0]  # [b or 1, 1, sq, sk]
    return compat.sdpa(q, kv[0], kv[1], attn_mask=mask, dropout_p=dropout_p)
