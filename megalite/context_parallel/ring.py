"""Ring attention (``--cp-comm-type p2p``): K/V chunks travel around the CP ring, attention is blockwise.

At step s = 0..n-1 ring member r holds the keys and values of member j = (r - s) mod n. Before computing
step s it posts the exchange for step s+1 (one batch: send what it holds to r+1, receive from r-1), so the
transfer overlaps the block's computation; n-1 exchanges in all. Every member posts the same batches in
the same order on the ring's communicator (``ProcessGroups.post_p2p(kind=...)``), which is NCCL-safe:
batch k of every rank holds exactly the messages of its neighbours' batch k. A send buffer is dropped as
soon as its exchange completes.

A member holds chunks of global positions (``Chunk``: two zigzag chunks per CP rank, or the 2a chunks of an
all-to-all group in hierarchical CP, ``hierarchical.py``); the block of member r's queries against member
j's keys is cut into the pieces ``attention.chunk_pieces`` allows: causal on the diagonal chunks, full where
the keys come before the queries, nothing after them — and, with packed documents, only inside each
document, so blocks masked across documents are skipped, not computed (the messages still travel: every
rank's batches stay the same). Q, K, V and O stay in the run's dtype; the merge, dQ and each holder's dK/dV
accumulate in fp32; dK/dV travel in the run's dtype.

The backward (``_RingAttention.backward``) recomputes each block from the saved q, k, v, output and
log-sum-exp, in the forward's order (dropout masks are redrawn from the saved generator state). The K/V
chunks travel the ring again (n-1 exchanges) and the dK/dV of owner j travels with them: started at member
j+1 (step 1), each later holder adds its part and passes it on; the last holder, j-1, passes it to j, which
adds its own block's part. So each rank sends n-1 K/V messages and n-1 dK/dV messages in the backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megalite import device
from megalite.attention import Chunk, Documents, chunk_pieces
from megalite.attention.blocks import attend, attend_backward
from megalite.context_parallel.zigzag import zigzag_chunks
from megalite.parallel.groups import Group, P2POp, P2PWork, ProcessGroups

ChunksOf = Callable[[int], list[Chunk]]  # ring member -> the chunks of global positions it holds, in local order


class Ring:
    """This rank's place in a ring of group ``kind`` (CP, or hierarchical CP's ring group), what every
    member holds, and the one kind of message: send to r+1, receive from r-1."""

    def __init__(self, pg: ProcessGroups, kind: str, chunks_of: ChunksOf) -> None:
        self.pg, self.kind, self.chunks_of = pg, kind, chunks_of
        self.n, self.r = pg.size(kind), pg.index(kind)

    def exchange(self, send: torch.Tensor, label: str) -> tuple[P2PWork, torch.Tensor]:
        recv = torch.empty_like(send)
        ops = [P2POp("send", send, (self.r + 1) % self.n, label), P2POp("recv", recv, (self.r - 1) % self.n, label)]
        return self.pg.post_p2p(ops, f"context-parallel ring, {label}", kind=self.kind), recv

    def pieces(self, documents: Documents, j: int) -> list:
        """The allowed pieces of this member's queries against member j's keys (local offsets)."""
        return chunk_pieces(documents, self.chunks_of(self.r), self.chunks_of(j))


def ring_forward(ring: Ring, q: torch.Tensor, kv: torch.Tensor, documents: Documents, p: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (out [b, h, s, d], lse [b, h, s]) of this member's queries q [b, h, s, d] over the ring's K/V;
    kv [2, b, g, s, d] is this member's, in the run's dtype."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
    for step in range(ring.n):
        j = (ring.r - step) % ring.n
        if step + 1 < ring.n:
            work, nxt = ring.exchange(kv, f"kv step {step + 1}")  # posted before this block's compute
        attend(q, kv, ring.pieces(documents, j), out, lse, p)
        if step + 1 < ring.n:
            work.wait()
            kv = nxt
    return out, lse


def ring_backward(ring: Ring, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  dout: torch.Tensor, documents: Documents, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq fp32 [b, h, s, d], dkv fp32 [2, b, g, s, d]) for this member's q and its own K/V."""
    delta = (dout.float() * out.float()).sum(dim=-1)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    own = dkv_work = dkv_in = None
    for step in range(ring.n):
        j = (ring.r - step) % ring.n
        if step + 1 < ring.n:
            kv_work, kv_next = ring.exchange(kv, f"kv step {step + 1}")
        dkv = attend_backward(q, kv, ring.pieces(documents, j), out, lse, dout, delta, dq, p)
        if step == 0:
            own = dkv
        else:
            if dkv_work is not None:  # owner j's sum so far, from member r-1 (which held j at step - 1)
                dkv_work.wait()
                dkv += dkv_in.float()
            # on to r+1 in the run's dtype; at the last step r+1 is j
            dkv_work, dkv_in = ring.exchange(dkv.to(kv.dtype), f"dkv step {step + 1}")
        if step + 1 < ring.n:
            kv_work.wait()
            kv = kv_next
    if dkv_work is not None:  # every other member's part of this member's dK/dV
        dkv_work.wait()
        own += dkv_in.float()
    return dq, own


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, documents: Documents,
                p: float) -> torch.Tensor:
        ctx.ring, ctx.documents, ctx.p = ring, documents, p
        ctx.rng = device.get_rng_state() if p > 0 else None  # the backward redraws the same masks
        out, lse = ring_forward(ring, q, torch.stack([k, v]), documents, p)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        saved = None
        if ctx.rng is not None:
            saved = device.get_rng_state()
            device.set_rng_state(ctx.rng)
        try:
            dq, dkv = ring_backward(ctx.ring, q, torch.stack([k, v]), out, lse, dout.contiguous(), ctx.documents,
                                    ctx.p)
        finally:
            if saved is not None:
                device.set_rng_state(saved)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_over(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, documents: Documents,
              dropout_p: float) -> torch.Tensor:
    """Attention of this member's queries over every member's keys, K/V passed around ``ring``."""
    return _RingAttention.apply(q, k, v, ring, documents, dropout_p)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pg: ProcessGroups,
                   documents: Documents, dropout_p: float) -> torch.Tensor:
    """Causal attention of this rank's zigzag rows over the whole sequence, K/V passed around the CP ring."""
    c, s_local = pg.size(Group.CP), q.shape[2]
    return ring_over(q, k, v, Ring(pg, Group.CP, lambda j: zigzag_chunks(j, c, s_local)), documents, dropout_p)
