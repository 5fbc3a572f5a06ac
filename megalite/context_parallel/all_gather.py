"""Gathered-K/V attention (``--cp-comm-type allgather``): every rank gathers all keys and values over CP
and keeps its own queries. The attention is the ring's blockwise computation with every holder's chunks
already local (no mask: the pieces of ``attention.chunk_pieces``, causal and per document), so nothing of
size s_local x s is built. The backward computes the dK/dV of every holder's keys and reduce-scatters
them: each owner keeps the sum of its own chunks' part."""

from __future__ import annotations

import torch

from megalite import device
from megalite.attention import Documents, chunk_pieces
from megalite.attention.blocks import attend, attend_backward
from megalite.context_parallel.zigzag import zigzag_chunks
from megalite.parallel.groups import Group, ProcessGroups


def _pieces(documents: Documents, c: int, r: int, s_local: int, j: int) -> list:
    return chunk_pieces(documents, zigzag_chunks(r, c, s_local), zigzag_chunks(j, c, s_local))


def _holders(c: int, r: int) -> list[int]:
    """The order blocks are computed in: the own block first (every row then has a finite log-sum-exp)."""
    return [(r - s) % c for s in range(c)]


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pg: ProcessGroups, documents: Documents,
                p: float, softcap: float) -> torch.Tensor:
        c, r = pg.size(Group.CP), pg.index(Group.CP)
        ctx.pg, ctx.documents, ctx.p, ctx.softcap = pg, documents, p, softcap
        ctx.rng = device.get_rng_state() if p > 0 else None
        kv = torch.stack([k, v])
        every = torch.empty((c, *kv.shape), dtype=kv.dtype, device=kv.device)
        pg.all_gather_flat(every.view(-1), kv.reshape(-1), Group.CP, label="all_gather kv")
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
        for j in _holders(c, r):
            attend(q, every[j], _pieces(documents, c, r, q.shape[2], j), out, lse, p, softcap)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, every, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, every, out, lse = ctx.saved_tensors
        pg, c, r = ctx.pg, ctx.pg.size(Group.CP), ctx.pg.index(Group.CP)
        saved = None
        if ctx.rng is not None:
            saved = device.get_rng_state()
            device.set_rng_state(ctx.rng)
        try:
            dout = dout.contiguous()
            delta = (dout.float() * out.float()).sum(dim=-1)
            dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            dkv = torch.empty(every.shape, dtype=every.dtype, device=every.device)
            for j in _holders(c, r):
                dkv[j] = attend_backward(q, every[j], _pieces(ctx.documents, c, r, q.shape[2], j), out, lse, dout,
                                         delta, dq, ctx.p, ctx.softcap)
        finally:
            if saved is not None:
                device.set_rng_state(saved)
        own = torch.empty(every.shape[1:], dtype=every.dtype, device=every.device)
        pg.reduce_scatter_flat(own.view(-1), dkv.reshape(-1), Group.CP, label="reduce_scatter dkv")
        return dq.to(q.dtype), own[0], own[1], None, None, None, None


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pg: ProcessGroups,
                         documents: Documents, dropout_p: float, softcap: float = 0.0) -> torch.Tensor:
    """``softcap``: the logit cap of every block (--attn-logit-softcapping; 0: none)."""
    return _AllGatherAttention.apply(q, k, v, pg, documents, dropout_p, softcap)
