"""BuildContext: the run-wide settings every model and MoE layer is built with, in one frozen object.

The model's shape and per-layer options live in ModelConfig; what a layer needs from the run around it
(process groups, RNG tracker, parameter dtype and device, sequence parallelism, the CP attention kind)
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
    cp_comm_type: str = "p2p"  # context-parallel attention: p2p (ring), a2a or allgather
