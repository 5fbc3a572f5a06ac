"""BuildContext: the run-wide settings every model and MoE layer is built with, in one frozen object.

The model's shape and per-layer options live in ModelConfig; what a layer needs from the run around it
(process groups, RNG tracker, parameter dtype and device, sequence parallelism, each layer's CP attention kind)
travels here, made once by build_model(). So a layer's constructor is ``(cfg, ctx)`` plus what differs
between its instances, and a new run-wide setting is one field here instead of an argument threaded
through every layer. It lives in this layer so that moe/ and model/ can both import it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.random import RNGTracker


@dataclass(frozen=True)
class BuildContext:
    pg: ProcessGroups
    tracker: RNGTracker  # dropout RNG of the TP-sharded regions (also used by recomputation)
    dtype: torch.dtype = torch.float32  # the parameters' dtype (--bf16/--fp16: params_dtype)
    device: torch.device | None = None  # where parameters are created (None: torch's default; "meta": no memory)
    sequence_parallel: bool = False  # activations between the TP regions are split over the sequence
    # context-parallel attention of each layer (0-based; one entry: every layer): p2p (ring), a2a, allgather or
    # a2a+p2p, the internal names (config/parallel.py: CP_COMM_TYPES)
    cp_comm_types: tuple[str, ...] = ("p2p",)

    def layer_cp_comm_type(self, layer_number: int) -> str:
        """The CP attention kind of global layer ``layer_number`` (0-based)."""
        types = self.cp_comm_types
        return types[0] if len(types) == 1 else types[layer_number]

    @property
    def hierarchical_cp(self) -> tuple[int, ...] | None:
        """--hierarchical-context-parallel-sizes (a2a+p2p: the all-to-all group's size, then the ring's
        levels), as the ProcessGroups were built with them; None when not given."""
        return self.pg.layout.hierarchical_cp
