"""Measure, on CPU, what the planner's memory terms predict: the bytes autograd saves per transformer layer
(parameter storages excluded, views of them included in that exclusion) and the bytes of parameters,
gradients and optimizer state a rank holds, and the bytes it hands to MoE token dispatch. Used by
tests/test_planning.py and tests/test_planning_moe.py."""

from __future__ import annotations

import torch

from megalite.config.model import ModelConfig
from megalite.model.activation_memory import bytes_per_layer
from megalite.parallel.groups import ProcessGroups


def layer_activation_bytes(cfg: ModelConfig, pg: ProcessGroups, micro_batch: int, vocab: int, *,
                           sequence_parallel: bool = False, dtype: torch.dtype = torch.bfloat16) -> int:
    """Saved bytes of one transformer layer: a 2-layer model's layers minus a 1-layer model's."""
    return int(bytes_per_layer(cfg, pg, micro_batch, vocab, sequence_parallel=sequence_parallel, dtype=dtype,
                               exclude_weights=True))


def dispatch_comm_bytes(pg: ProcessGroups) -> dict[tuple[str, str], int]:
    """Bytes this rank handed to MoE token-dispatch collectives so far, keyed (group kind, label) as
    ProcessGroups.comm_bytes counts them (labels moe_*; what planning/moe.py:dispatch_comm_bytes predicts)."""
    return {key: v for key, v in pg.comm_bytes.items() if key[1].startswith("moe_")}
