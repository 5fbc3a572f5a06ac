"""Which global layers each (pipeline rank, model chunk) holds.

With v model chunks per rank (interleaved 1F1B) the layers are cut into p*v virtual stages of
L/(p*v) layers, assigned round-robin: virtual stage s = chunk * p + rank. With v = 1 this is the
plain contiguous split. The first virtual stage owns the embedding, the last the output layer.
"""

from __future__ import annotations


def virtual_stage(rank: int, chunk: int, pp: int) -> int:
    return chunk * pp + rank


def chunk_layers(num_layers: int, pp: int, vp: int, rank: int, chunk: int) -> list[int]:
    """Global layer numbers of (rank, chunk)."""
    per = num_layers // (pp * vp)
    start = virtual_stage(rank, chunk, pp) * per
    return list(range(start, start + per))


def num_chunks(num_layers: int, pp: int, layers_per_virtual_stage: int | None) -> int:
    """v: model chunks per pipeline rank."""
    if layers_per_virtual_stage is None:
        return 1
    return num_layers // (pp * layers_per_virtual_stage)
