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

With a sliding window (``documents.window``) a message carries only what a later holder needs
(``Compaction``): the K/V of owner j that leaves for step t holds the key positions some member among
j+t, ..., j+n-1 attends to (a nested set that shrinks along the ring; a step with none sends nothing),
and owner j's dK/dV travels in the layout of step 1's set. So the bytes follow the window, not s/c: with
one document per sample and W - 1 <= s/(2c), a message holds at most the 2(W - 1) positions the window
reaches into the two chunks (docs/design.md, "Sliding windows", gives the formula the tests count against).

With --attn-logit-softcapping every block caps its scores (``blocks.forward``) before the log-sum-exp merge, and
its backward multiplies the score gradient by the cap's derivative: the merge itself is unchanged.
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

    def exchange(self, send: torch.Tensor | None, label: str, recv_positions: int | None = None
                 ) -> tuple[P2PWork | None, torch.Tensor | None]:
        """Send ``send`` to r+1 and receive from r-1 a tensor of send's shape, or with ``recv_positions``
        that many positions (dim 3, the sequence of [2, b, g, s, d]); a None send or 0 positions is left
        out (both ends of a message decide it alike), and nothing posted when both are."""
        recv = None
        shape = None if send is None else send.shape
        if recv_positions is not None and recv_positions > 0:
            shape = (*self._like.shape[:3], recv_positions, self._like.shape[4])
        elif recv_positions == 0:
            shape = None
        ops = []
        if send is not None:
            ops.append(P2POp("send", send, (self.r + 1) % self.n, label))
        if shape is not None:
            recv = torch.empty(shape, dtype=self._like.dtype if send is None else send.dtype,
                               device=self._like.device)
            ops.append(P2POp("recv", recv, (self.r - 1) % self.n, label))
        if not ops:
            return None, None
        return self.pg.post_p2p(ops, f"context-parallel ring, {label}", kind=self.kind), recv

    def pieces(self, documents: Documents, j: int, keys: list[Chunk] | None = None) -> list:
        """The allowed pieces of this member's queries against member j's keys (local offsets); ``keys``:
        the chunks a compacted message holds instead of all of j's."""
        return chunk_pieces(documents, self.chunks_of(self.r), keys if keys is not None else self.chunks_of(j))


class Compaction:
    """What each ring message must carry under a sliding window (module doc). ``keep(t, j)``: the sorted
    local key positions of owner j that the holders at steps t.., that is members j+t, ..., j+n-1, attend to;
    step 0 is all of them."""

    def __init__(self, ring: Ring, documents: Documents, s_local: int) -> None:
        self.ring, self.documents, self.s_local = ring, documents, s_local
        n = ring.n
        # need[m][j]: the ranges of j's local positions member m's pieces reach
        need = [[[(p.k0, p.k1) for p in chunk_pieces(documents, ring.chunks_of(m), ring.chunks_of(j))]
                 if m != j else [] for j in range(n)] for m in range(n)]
        self._keep: dict[tuple[int, int], list[int]] = {}
        self._memo: dict = {}
        for j in range(n):
            acc: list[tuple[int, int]] = []
            for t in range(n - 1, 0, -1):
                acc = _union(acc + need[(j + t) % n][j])
                self._keep[(t, j)] = [c for a, b in acc for c in range(a, b)]

    def keep(self, t: int, j: int) -> list[int]:
        return list(range(self.s_local)) if t == 0 else self._keep[(t, j)]

    def _where(self, j: int, inner: int, outer: int) -> list[int]:
        """Where each position of layout keep(inner, j) sits in layout keep(outer, j) (which holds it)."""
        key = ("where", j, inner, outer)
        if key not in self._memo:
            pos = {c: i for i, c in enumerate(self.keep(outer, j))}
            self._memo[key] = [pos[c] for c in self.keep(inner, j)]
        return self._memo[key]

    def select(self, kv: torch.Tensor, j: int, held: int, to: int) -> torch.Tensor | None:
        """Owner j's K/V in layout keep(held) cut to layout keep(to) (None when that is empty)."""
        idx = self._where(j, to, held)
        return kv.index_select(3, torch.tensor(idx, device=kv.device)) if idx else None

    def scatter(self, part: torch.Tensor, j: int, held: int, to: int) -> torch.Tensor:
        """fp32 dK/dV in layout keep(held) placed in layout keep(to) (which holds it), zeros elsewhere."""
        out = torch.zeros((*part.shape[:3], len(self.keep(to, j)), part.shape[4]), dtype=part.dtype,
                          device=part.device)
        idx = self._where(j, held, to)
        if idx:
            out.index_add_(3, torch.tensor(idx, device=part.device), part)
        return out

    def chunks(self, t: int, j: int) -> list[Chunk]:
        """Owner j's chunks as held in layout keep(t): runs of consecutive positions inside each chunk."""
        if ("chunks", t, j) not in self._memo:
            self._memo[("chunks", t, j)] = self._chunks(t, j)
        return self._memo[("chunks", t, j)]

    def _chunks(self, t: int, j: int) -> list[Chunk]:
        cols, out = self.keep(t, j), []
        at = {c: i for i, c in enumerate(cols)}
        for ch in self.ring.chunks_of(j):
            run = None
            for c in range(ch.local, ch.local + ch.length):
                if c in at and run is not None and c == run[0] + run[1]:
                    run[1] += 1
                    continue
                if run is not None:
                    out.append(Chunk(ch.start + run[0] - ch.local, run[1], at[run[0]]))
                run = [c, 1] if c in at else None
            if run is not None:
                out.append(Chunk(ch.start + run[0] - ch.local, run[1], at[run[0]]))
        return out


def ring_forward(ring: Ring, q: torch.Tensor, kv: torch.Tensor, documents: Documents, p: float,
                 softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (out [b, h, s, d], lse [b, h, s]) of this member's queries q [b, h, s, d] over the ring's K/V;
    kv [2, b, g, s, d] is this member's, in the run's dtype; ``softcap``: the logit cap of every block."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
    plan = _plan(ring, documents, kv)
    for step in range(ring.n):
        j = (ring.r - step) % ring.n
        if step + 1 < ring.n:
            work, nxt = _pass_kv(ring, plan, kv, step)  # posted before this block's compute
        if kv is not None:
            attend(q, kv, _pieces(ring, plan, documents, step, j), out, lse, p, softcap)
        if step + 1 < ring.n:
            if work is not None:
                work.wait()
            kv = nxt
    return out, lse


def _union(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, merged half-open ranges."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


_PLANS: dict = {}  # (every member's chunks, this member, documents) -> Compaction: once per layout, not per layer


def _plan(ring: Ring, documents: Documents, kv: torch.Tensor) -> Compaction | None:
    ring._like = kv
    if not documents.window or ring.n == 1:
        return None
    key = (tuple(tuple(ring.chunks_of(m)) for m in range(ring.n)), ring.r, documents)
    if key not in _PLANS:
        if len(_PLANS) > 64:  # packed documents change per micro-batch: keep the recent ones
            _PLANS.clear()
        _PLANS[key] = Compaction(ring, documents, kv.shape[3])
    return _PLANS[key]


def _pass_kv(ring: Ring, plan: Compaction | None, kv: torch.Tensor | None, step: int):
    """Post the K/V exchange for step + 1: this member's held K/V on, the previous member's in."""
    label = f"kv step {step + 1}"
    if plan is None:
        return ring.exchange(kv, label)
    j, j_in = (ring.r - step) % ring.n, (ring.r - 1 - step) % ring.n
    send = None if kv is None else plan.select(kv, j, step, step + 1)
    return ring.exchange(send, label, recv_positions=len(plan.keep(step + 1, j_in)))


def _pieces(ring: Ring, plan: Compaction | None, documents: Documents, step: int, j: int) -> list:
    return ring.pieces(documents, j, None if plan is None or step == 0 else plan.chunks(step, j))


def ring_backward(ring: Ring, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  dout: torch.Tensor, documents: Documents, p: float, softcap: float = 0.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq fp32 [b, h, s, d], dkv fp32 [2, b, g, s, d]) for this member's q and its own K/V (each block's
    gradient through its logit cap, ``softcap``)."""
    delta = (dout.float() * out.float()).sum(dim=-1)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    own = dkv_work = dkv_in = None
    dtype = kv.dtype
    plan = _plan(ring, documents, kv)
    for step in range(ring.n):
        j = (ring.r - step) % ring.n
        if step + 1 < ring.n:
            kv_work, kv_next = _pass_kv(ring, plan, kv, step)
        dkv = None if kv is None else attend_backward(q, kv, _pieces(ring, plan, documents, step, j), out, lse,
                                                      dout, delta, dq, p, softcap)
        if step == 0:
            own = dkv
        else:
            if plan is not None and dkv is not None:  # owner j's dK/dV travels in step 1's layout
                dkv = plan.scatter(dkv, j, step, 1)
            if dkv_work is not None:  # owner j's sum so far, from member r-1 (which held j at step - 1)
                dkv_work.wait()
                if dkv_in is not None:
                    dkv = dkv_in.float() if dkv is None else dkv + dkv_in.float()
            # on to r+1 in the run's dtype; at the last step r+1 is j
            recv = None if plan is None else len(plan.keep(1, (ring.r - 1 - step) % ring.n))
            dkv_work, dkv_in = ring.exchange(None if dkv is None else dkv.to(dtype), f"dkv step {step + 1}", recv)
        if step + 1 < ring.n:
            if kv_work is not None:
                kv_work.wait()
            kv = kv_next
    if dkv_work is not None:  # every other member's part of this member's dK/dV
        dkv_work.wait()
        if dkv_in is not None:
            own += dkv_in.float() if plan is None else plan.scatter(dkv_in.float(), ring.r, 1, 0)
    return dq, own


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, documents: Documents,
                p: float, softcap: float) -> torch.Tensor:
        ctx.ring, ctx.documents, ctx.p, ctx.softcap = ring, documents, p, softcap
        ctx.rng = device.get_rng_state() if p > 0 else None  # the backward redraws the same masks
        out, lse = ring_forward(ring, q, torch.stack([k, v]), documents, p, softcap)
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
                                    ctx.p, ctx.softcap)
        finally:
            if saved is not None:
                device.set_rng_state(saved)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_over(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, documents: Documents,
              dropout_p: float, softcap: float = 0.0) -> torch.Tensor:
    """Attention of this member's queries over every member's keys, K/V passed around ``ring``."""
    return _RingAttention.apply(q, k, v, ring, documents, dropout_p, softcap)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pg: ProcessGroups,
                   documents: Documents, dropout_p: float, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of this rank's zigzag rows over the whole sequence, K/V passed around the CP ring."""
    c, s_local = pg.size(Group.CP), q.shape[2]
    return ring_over(q, k, v, Ring(pg, Group.CP, lambda j: zigzag_chunks(j, c, s_local)), documents, dropout_p,
                     softcap)
