"""The vocabulary of schedule tables (``Action``, ``ScheduleSpec``) and which virtual stage each (pipeline
rank, model chunk) holds (``StageMap``, defined with the layer split in parallel/placement.py).

Two placements: round-robin (1F1B, interleaved 1F1B: virtual stage s = chunk·p + rank, so a micro-batch
goes round the ranks v times) and the V shape of ZB-V (two chunks per rank: chunk 0 is stage r, chunk 1
stage 2p−1−r, so a micro-batch goes down the ranks and back up; rank p−1 hands its chunk 0's output to
its own chunk 1, and rank 0 holds both the first and the last stage: the embedding and the loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from megalite.parallel.placement import StageMap

__all__ = ["ZERO_BUBBLE", "Action", "ScheduleSpec", "StageMap"]


class Action(NamedTuple):
    kind: str  # "F", "B" (the whole backward, or its input-gradient part where the table has "W"s) or "W"
    chunk: int
    microbatch: int


ZERO_BUBBLE = ("zb-h1", "zbv")  # the schedules whose backward is split into B and W


@dataclass(frozen=True)
class ScheduleSpec:
    pp: int
    vp: int
    microbatches: int
    kind: str = "1f1b"  # "1f1b", "gpipe" (interleaved when vp > 1), "zb-h1" or "zbv"
    # zero bubble: per rank, the most chunk-micro-batches held between their F and their W (activations
    # and pending W's); None: the schedule's own (ZB-H1 p, ZB-V 2p). A smaller hold trades bubble for
    # bytes (planning/zero_bubble_memory.py chooses it from the model's bytes, zero_bubble.py applies it)
    holds: tuple[int, ...] | None = None

    @property
    def stages(self) -> StageMap:
        return StageMap(self.pp, self.vp, v_shape=self.kind == "zbv")

    def hold(self, rank: int) -> int:
        """Rank ``rank``'s hold (see ``holds``)."""
        own = self.pp * self.vp
        return own if self.holds is None else min(self.holds[rank], own)

    @property
    def split_backward(self) -> bool:
        return self.kind in ZERO_BUBBLE
