"""Sliding-window attention (``--window-size``) cut into blocks, so its cost follows the window, not s².

A query at position i sees the keys j with i - W < j <= i of its own document (W = the window's left
size + 1, the Hugging Face ``sliding_window`` convention; Megatron-LM's ``--window-size L 0`` is W = L + 1).
``band_pieces`` cuts one allowed block of ``documents.pieces`` (a causal square or keys wholly before the
queries) into query tiles of at most ``TILE`` rows, and each tile's keys into at most three pieces:
- the causal square on the diagonal (every one of its pairs lies inside the window: the tile is < W rows);
- the keys every row of the tile sees: a full rectangle;
- the band at the window's far edge, where row t of the tile sees only the later columns: a square whose
  row t sees columns t.. (``flip``: the causal kernels run it on reversed rows and columns), or, where a
  document, sequence or chunk edge clips it, a block with the band mask (``window``), its rows cut to those
  that see a key.
Tiles and keys wholly outside the window give no piece, so the blockwise paths (serial, and the context-
parallel ring and all-gather) skip their compute. Every piece's rows each see at least one key (the
log-sum-exp merge needs a finite value per row).
"""

from __future__ import annotations

# Query rows per tile of a windowed block: the far-edge band costs about TILE/2 pairs per row beyond W.
TILE = 256

# (q0, q1, k0, k1, causal, flip, window, lag) of one piece, in global positions
Cut = tuple[int, int, int, int, bool, bool, int, int]


def band_pieces(qa: int, qb: int, ka: int, kb: int, same: bool, window: int) -> list[Cut]:
    """The pieces of queries qa:qb against keys ka:kb (``same``: the same range, causal; else keys wholly
    before the queries) that a window of ``window`` keys allows."""
    tile = max(1, min(TILE, window - 1))
    out: list[Cut] = []
    for r0 in range(qa, qb, tile):
        r1 = min(r0 + tile, qb)
        if same:
            out.append((r0, r1, r0, r1, True, False, 0, 0))
        hi = min(kb, r0)  # keys before the tile's rows
        lo = max(ka, r0 - window + 1)  # the earliest key the tile's first row sees
        if lo >= hi:
            continue
        split = min(hi, max(lo, r1 - window + 1))  # keys from here on are seen by every row of the tile
        if split < hi:
            out.append((r0, r1, split, hi, False, False, 0, 0))
        if lo < split:
            if lo == r0 - window + 1 and split - lo == r1 - r0:
                out.append((r0, r1, lo, split, False, True, 0, 0))
            else:
                rows_end = min(r1, split + window - 1)  # row i sees a key below split when i - W + 1 < split
                out.append((r0, rows_end, lo, split, False, False, window, r0 - lo))
    return out

