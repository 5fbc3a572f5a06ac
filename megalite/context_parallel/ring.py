"""Ring attention (``--cp-comm-type p2p``): K/V chunks travel around the CP ring, attention is blockwise.

At step s = 0..c-1 rank r holds the keys and values of rank j = (r - s) mod c. Before computing step s it
posts the exchange for step s+1 (one batch: send what it holds to r+1, receive from r-1), so the
transfer overlaps the block's computation; c-1 exchanges in all. Every rank posts the same batches in
the same order on the CP group's communicator (``ProcessGroups.post_p2p(kind=Group.CP)``), which is
NCCL-safe: batch k of every rank holds exactly the messages of its neighbours' batch k.

With the zigzag split the causal structure of a block is known from r and j alone (``block``): the own
block is causal, a block from an earlier rank is seen by all rows but only through its first chunk, one
from a later rank only by the second chunk of rows; the empty parts are skipped (the messages are not).

The backward (``_RingAttention.backward``) recomputes each block from the saved q, k, v and log-sum-exp,
in the forward's order (dropout masks are redrawn from the saved generator state). The K/V chunks travel
the ring again (c-1 exchanges) and the fp32 dK/dV of owner j travels with them: started at rank j+1 (step
1), each later holder adds its part and passes it on; the last holder, rank j-1, passes it to j, which adds
its own block's part. So each rank sends c-1 K/V messages and c-1 dK/dV messages in the backward.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megalite import device
from megalite.context_parallel import blockwise
from megalite.context_parallel.zigzag import zigzag_positions
from megalite.parallel.groups import Group, P2POp, P2PWork, ProcessGroups

# Query rows per piece of a block: bounds the scores that exist at once to ROW_TILE x s_local per head.
ROW_TILE = 1024


def block(r: int, j: int, s_local: int) -> tuple[slice, slice, bool]:
    """(query rows, key columns, needs the causal mask) of rank r's queries against rank j's keys: the
    part of the block that is not fully masked under the zigzag split."""
    half = s_local // 2
    if j == r:
        return slice(0, s_local), slice(0, s_local), True
    if j < r:  # chunks j and 2c-1-j: only chunk j (< r < 2c-1-r) is in the past of this rank's rows
        return slice(0, s_local), slice(0, half), False
    return slice(half, s_local), slice(0, s_local), False  # only chunk 2c-1-r comes after both of j's


class _Ring:
    """This rank's place in the CP ring and its one kind of message: send to r+1, receive from r-1."""

    def __init__(self, pg: ProcessGroups) -> None:
        self.pg, self.c, self.r = pg, pg.size(Group.CP), pg.index(Group.CP)

    def exchange(self, send: torch.Tensor, label: str) -> tuple[P2PWork, torch.Tensor]:
        recv = torch.empty_like(send)
        ops = [P2POp("send", send, (self.r + 1) % self.c, label), P2POp("recv", recv, (self.r - 1) % self.c, label)]
        return self.pg.post_p2p(ops, f"context-parallel ring, {label}", kind=Group.CP), recv


def _grouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, heads, s, d] -> fp32 [b, groups, heads / groups, s, d]: query heads under their K/V head."""
    b, h, s, d = t.shape
    return t.float().reshape(b, groups, h // groups, s, d)


def _pieces(r: int, j: int, pos: torch.Tensor, segment_ids: torch.Tensor | None, shape: tuple, p: float
            ) -> Iterator[tuple[slice, slice, torch.Tensor | None, torch.Tensor | None]]:
    """The block of rank j's keys in tiles of at most ROW_TILE query rows (so no more than ROW_TILE x s_local
    scores per head exist at once): rows, columns, attention mask and dropout factors (drawn in order)."""
    rows, cols, causal = block(r, j, pos.shape[1])
    b, g, rep = shape
    for start in range(rows.start, rows.stop, ROW_TILE):
        tile = slice(start, min(start + ROW_TILE, rows.stop))
        mask = blockwise.allowed(pos[r][tile], pos[j][cols], segment_ids, causal)
        keep = blockwise.dropout_mask((b, g, rep, tile.stop - tile.start, cols.stop - cols.start), p, pos.device)
        yield tile, cols, mask, keep


def ring_forward(ring: _Ring, q: torch.Tensor, kv: torch.Tensor, segment_ids: torch.Tensor | None, p: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (out [b, g, rep, s_local, d], lse [b, g, rep, s_local]); q grouped fp32, kv [2, b, g, s_local, d]."""
    c, r = ring.c, ring.r
    pos = zigzag_positions(q.shape[3], c, q.device)
    out, lse = torch.zeros_like(q), torch.full(q.shape[:4], float("-inf"), device=q.device)
    for step in range(c):
        j = (r - step) % c
        if step + 1 < c:
            work, nxt = ring.exchange(kv, f"kv step {step + 1}")  # posted before this block's compute
        for rows, cols, mask, keep in _pieces(r, j, pos, segment_ids, q.shape[:3], p):
            k, v = (t[:, :, None, cols].float() for t in kv)
            o, lb = blockwise.forward(q[:, :, :, rows], k, v, mask, keep)
            if step == 0:  # the own block: every row sees itself, so lse is finite from here on
                out[:, :, :, rows], lse[:, :, :, rows] = o, lb
            else:
                blockwise.merge(out[:, :, :, rows], lse[:, :, :, rows], o, lb)
        if step + 1 < c:
            work.wait()
            kv = nxt
    return out, lse


def _block_grads(r: int, j: int, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 dout: torch.Tensor, delta: torch.Tensor, dq: torch.Tensor, pos: torch.Tensor,
                 segment_ids: torch.Tensor | None, p: float) -> torch.Tensor:
    """Add this block's part to ``dq``; return its fp32 dK/dV [2, b, g, s_local, d] for rank j's keys."""
    dkv = torch.zeros((2, *kv.shape[1:]), dtype=torch.float32, device=q.device)
    for rows, cols, mask, keep in _pieces(r, j, pos, segment_ids, q.shape[:3], p):
        k, v = (t[:, :, None, cols].float() for t in kv)
        dq_b, dk, dv = blockwise.backward(q[:, :, :, rows], k, v, mask, keep, lse[:, :, :, rows],
                                          dout[:, :, :, rows], out[:, :, :, rows], delta[:, :, :, rows])
        dq[:, :, :, rows] += dq_b
        dkv[0][:, :, cols] += dk.squeeze(2)
        dkv[1][:, :, cols] += dv.squeeze(2)
    return dkv


def ring_backward(ring: _Ring, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  dout: torch.Tensor, segment_ids: torch.Tensor | None, p: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq grouped fp32, dkv fp32 [2, b, g, s_local, d]) for this rank's q and its own K/V."""
    c, r = ring.c, ring.r
    pos = zigzag_positions(q.shape[3], c, q.device)
    delta = (dout * out).sum(dim=-1)
    dq = torch.zeros_like(q)
    own = dkv_work = dkv_in = None
    for step in range(c):
        j = (r - step) % c
        if step + 1 < c:
            kv_work, kv_next = ring.exchange(kv, f"kv step {step + 1}")
        dkv = _block_grads(r, j, q, kv, out, lse, dout, delta, dq, pos, segment_ids, p)
        if step == 0:
            own = dkv
        else:
            if dkv_work is not None:  # owner j's sum so far, from rank r-1 (which held j at step - 1)
                dkv_work.wait()
                dkv += dkv_in
            dkv_work, dkv_in = ring.exchange(dkv, f"dkv step {step + 1}")  # on to r+1; at the last step r+1 is j
        if step + 1 < c:
            kv_work.wait()
            kv = kv_next
    if dkv_work is not None:  # every other rank's part of this rank's dK/dV
        dkv_work.wait()
        own += dkv_in
    return dq, own


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pg: ProcessGroups,
                segment_ids: torch.Tensor | None, p: float) -> torch.Tensor:
        ctx.ring, ctx.p = _Ring(pg), p
        ctx.rng = device.get_rng_state() if p > 0 else None  # the backward redraws the same masks
        out, lse = ring_forward(ctx.ring, _grouped(q, k.shape[1]), torch.stack([k, v]), segment_ids, p)
        ctx.save_for_backward(q, k, v, out, lse, segment_ids)
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse, segment_ids = ctx.saved_tensors
        g = k.shape[1]
        saved = None
        if ctx.rng is not None:
            saved = device.get_rng_state()
            device.set_rng_state(ctx.rng)
        try:
            dq, dkv = ring_backward(ctx.ring, _grouped(q, g), torch.stack([k, v]), out, lse, _grouped(dout, g),
                                    segment_ids, ctx.p)
        finally:
            if saved is not None:
                device.set_rng_state(saved)
        return dq.reshape(q.shape).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pg: ProcessGroups,
                   segment_ids: torch.Tensor | None, dropout_p: float) -> torch.Tensor:
    """Causal attention of this rank's zigzag rows over the whole sequence, K/V passed around the ring."""
    return _RingAttention.apply(q, k, v, pg, segment_ids, dropout_p)
