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

import dataclasses
from dataclasses import dataclass

import torch

from megalite.attention.window import band_pieces


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
    # Sliding windows (``window.py`` cuts them): ``flip``, a square whose row t sees columns t.. (the causal
    # square mirrored, which the causal kernels run on the reversed rows and columns); ``window`` > 0, a
    # block with its band mask: row t sees column c when 0 <= t + lag - c < window, ``lag`` being the
    # global position of row 0 minus that of column 0 (kept when the piece is shifted to local offsets).
    flip: bool = False
    window: int = 0
    lag: int = 0

    @property
    def pairs(self) -> int:
        """Query-key pairs the piece computes (per sample)."""
        n, m = self.q1 - self.q0, self.k1 - self.k0
        if self.window:
            return sum(max(0, min(m, t + self.lag + 1) - max(0, t + self.lag - self.window + 1)) for t in range(n))
        return n * (n + 1) // 2 if self.causal or self.flip else n * m

    def shifted(self, dq: int, dk: int) -> Piece:
        """The same piece with rows and columns moved by dq and dk (global positions -> local offsets)."""
        return dataclasses.replace(self, q0=self.q0 + dq, q1=self.q1 + dq, k0=self.k0 + dk, k1=self.k1 + dk)


@dataclass(frozen=True)
class Documents:
    """Per sample, the boundaries 0 = e_0 < e_1 < ... < e_n = seq_length of its documents. ``uniform``: every
    sample is one document (plain causal attention), so pieces cover the whole batch at once."""

    seq_length: int
    bounds: tuple[tuple[int, ...], ...]
    uniform: bool = False
    # A sliding window: a query sees only the ``window`` latest keys (itself included) of its document; 0: all.
    window: int = 0

    def with_window(self, window: int) -> Documents:
        """The same documents seen through a sliding window of ``window`` keys (0: none)."""
        return dataclasses.replace(self, window=window)

    @classmethod
    def whole(cls, batch: int, seq_length: int, window: int = 0) -> Documents:
        """One document per sample: plain causal attention (through ``window`` when given)."""
        return cls(seq_length, ((0, seq_length),) * batch, uniform=True, window=window)

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
        keys wholly before the queries; nothing for keys after them. With a window, each of those cut to the
        band the window allows (``window.band_pieces``): blocks wholly outside it are not there."""
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
                    if self.window:
                        out += [Piece(batch, *cut) for cut in band_pieces(qa, qb, ka, kb, same, self.window)]
                    else:
                        out.append(Piece(batch, qa, qb, ka, kb, same))
        return out

    def work(self) -> int:
        """Query-key pairs causal attention inside the documents computes: Σ len (len + 1) / 2 (with a
        window, the pairs of its pieces)."""
        if self.window:
            per = [sum(p.pairs for p in self.pieces(0, self.seq_length, 0, self.seq_length) if p.batch == span)
                   for span, _ in self.spans()]
            return sum(per) * (self.batch if self.uniform else 1)
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
