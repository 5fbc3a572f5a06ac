"""Which global layers each (pipeline rank, model chunk) holds: parallel/placement.py's ``LayerSplit``,
the one rule model building, checkpointing and the planner share.

With v model chunks per rank (interleaved 1F1B) the layers are cut into p*v virtual stages, assigned
round-robin: virtual stage s = chunk * p + rank. With v = 1 this is the plain contiguous split. ZB-V places
its two chunks per rank in a V instead (``StageMap``). The split is even unless Megatron-LM's uneven flags
say otherwise (--decoder-first/last-pipeline-num-layers, the account-for flags, a layout string). The first
virtual stage owns the embedding, the last the output layer.
"""

from __future__ import annotations

from megalite.parallel.placement import LayerSplit, StageMap


def chunk_layers(num_layers: int, pp: int, vp: int, rank: int, chunk: int, stages: StageMap | None = None
                 ) -> list[int]:
    """Global layer numbers of (rank, chunk) of an even split (``stages``: the placement, default
    round-robin); an uneven one: ``LayerSplit.layers``."""
    v_shape = stages is not None and stages.v_shape
    return LayerSplit(num_layers, pp, vp, v_shape).layers(rank, chunk)


def num_chunks(num_layers: int, pp: int, layers_per_virtual_stage: int | None, schedule: str = "1f1b") -> int:
    """v: model chunks per pipeline rank (ZB-V: two, in a V)."""
    if schedule == "zbv":
        return 2
    if layers_per_virtual_stage is None:
        return 1
    return num_layers // (pp * layers_per_virtual_stage)


def placement(pp: int, vp: int, schedule: str = "1f1b") -> StageMap:
    """Where the virtual stages sit for ``schedule``: a V for ZB-V, round-robin otherwise."""
    return StageMap(pp, vp, v_shape=schedule == "zbv")


def loss_rank(pp: int, schedule: str = "1f1b") -> int:
    """The pipeline rank holding the last virtual stage (the loss): the first one under ZB-V's V."""
    stages = placement(pp, 2 if schedule == "zbv" else 1, schedule)
    return stages.holder(stages.last)[0]
