"""Document boundaries of packed sequences, and the blocks of attention they leave.

A packed sample holds several documents; with ``--reset-attention-mask`` a token attends only to earlier
tokens of its own document. The data path hands the boundaries as ``cu_seqlens`` (cumulative lengths over
the micro-batch flattened to one b·s stream, the variable-length kernels' convention); ``Documents`` keeps
them per sample as python ints, so that every attention path cuts its work into the rectangles and
triangles that are allowed instead of building a mask: the work is Σ len_i², and no tensor of size s² (nor a
sum of tiles that grows with s²) exists outside a kernel's own score tile.

``pieces`` is the one decomposition every path uses. Its arguments are two contiguous ranges of global
positions, a query range and a key range that are either the same range (a causal block) or disjoint (the
keys wholly before or after the queries): that covers the serial sequence (one range), the zigzag chunks of
context parallelism and the chunks a hierarchical group gathers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    """One allowed block: samples ``batch`` (a slice), query rows ``q0:q1`` and key columns ``k0:k1`` (global
    positions), ``causal`` (q0 == k0 and q1 == k1: row i sees columns up to i) or full."""

    batch: slice
    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool

    @property
    def pairs(self) -> int:
        """Query-key pairs the piece computes (per sample)."""
        n, m = self.q1 - self.q0, self.k1 - self.k0
        return n * (n + 1) // 2 if self.causal else n * m

    def shifted(self, dq: int, dk: int) -> Piece:
        """The same piece with rows and columns moved by dq and dk (global positions -> local offsets)."""
        return Piece(self.batch, self.q0 + dq, self.q1 + dq, self.k0 + dk, self.k1 + dk, self.causal)


@dataclass(frozen=True)
class Documents:
    """Per sample, the boundaries 0 = e_0 < e_1 < ... < e_n = seq_length of its documents. ``uniform``: every
    sample is one document (plain causal attention), so pieces cover the whole batch at once."""

    seq_length: int
    bounds: tuple[tuple[int, ...], ...]
    uniform: bool = False

    @classmethod
    def whole(cls, batch: int, seq_length: int) -> Documents:
        """One document per sample: plain causal attention."""
        return cls(seq_length, ((0, seq_length),) * batch, uniform=True)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, batch: int, seq_length: int) -> Documents:
        """From the flat boundaries over b·s tokens (each sample's start included), as the data path makes them."""
        cu = [int(x) for x in cu_seqlens.tolist()]
        total = batch * seq_length
        if cu[0] != 0 or cu[-1] != total or any(b <= a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must rise strictly from 0 to batch x seq = {total}, got {cu[:8]}...")
        starts = set(range(0, total + 1, seq_length))
        if not starts <= set(cu):
            raise ValueError(f"cu_seqlens must hold every sample's start (multiples of {seq_length})")
        rows = [[] for _ in range(batch)]
        for x in cu:
            b, off = divmod(x, seq_length)
            if b < batch:
                rows[b].append(off)
            if off == 0 and b > 0:
                rows[b - 1].append(seq_length)
        return cls(seq_length, tuple(tuple(r) for r in rows))

    @property
    def batch(self) -> int:
        return len(self.bounds)

    def lengths(self, sample: int) -> list[int]:
        e = self.bounds[sample]
        return [b - a for a, b in zip(e, e[1:])]

    def spans(self) -> list[tuple[slice, tuple[int, ...]]]:
        """(samples, boundaries): the whole batch once when uniform, else one sample at a time."""
        if self.uniform:
            return [(slice(None), self.bounds[0])]
        return [(slice(b, b + 1), e) for b, e in enumerate(self.bounds)]

    def pieces(self, q0: int, q1: int, k0: int, k1: int) -> list[Piece]:
        """The allowed blocks of queries q0:q1 against keys k0:k1 (global positions; the two ranges equal or
        disjoint): inside each document, the causal triangle of an equal range or the full rectangle of
        keys wholly before the queries; nothing for keys after them."""
        same = (q0, q1) == (k0, k1)
        if not same and not (k1 <= q0 or q1 <= k0):
            raise ValueError(f"query range {q0}:{q1} and key range {k0}:{k1} overlap without being equal")
        if not same and k0 >= q1:
            return []
        out = []
        for batch, e in self.spans():
            for a, b in zip(e, e[1:]):
                qa, qb, ka, kb = max(q0, a), min(q1, b), max(k0, a), min(k1, b)
                if qa < qb and ka < kb:
                    out.append(Piece(batch, qa, qb, ka, kb, same))
        return out

    def work(self) -> int:
        """Query-key pairs causal attention inside the documents computes: Σ len (len + 1) / 2."""
        return sum(n * (n + 1) // 2 for s in range(self.batch) for n in self.lengths(s))


@dataclass(frozen=True)
class Chunk:
    """A run of consecutive global positions ``start:start + length`` held at local offset ``local``."""

    start: int
    length: int
    local: int


def chunk_pieces(documents: Documents, queries: list[Chunk], keys: list[Chunk]) -> list[Piece]:
    """Every allowed piece between the held query chunks and key chunks, in local offsets (rows into the
    queries' tensor, columns into the keys')."""
    out = []
    for qc in queries:
        for kc in keys:
            for p in documents.pieces(qc.start, qc.start + qc.length, kc.start, kc.start + kc.length):
                out.append(p.shifted(qc.local - qc.start, kc.local - kc.start))
    return out
