"""Measure, on CPU, what the planner's memory terms predict: the bytes autograd saves per transformer layer
(parameter storages excluded, views of them included in that exclusion) and the bytes of parameters,
gradients and optimizer state a rank holds, and the bytes it hands to MoE token dispatch. Used by
tests/test_planning.py and tests/test_planning_moe.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite.config.model import ModelConfig
from megalite.model.activation_memory import bytes_per_layer
from megalite.parallel.groups import ProcessGroups
from megalite.planning.shape import RunShape

# What F.rms_norm keeps for backward of a [96, 3, 64] bf16 input and its weight on the releases the
# planner's RMSNorm term (6 bytes per channel, docs/design.md 3.5) is exact for: torch 2.11 on. Torch 2.6
# keeps one bf16 copy of the input less (4 bytes per channel), so the planner counts 2 bytes too many there.
_RMS_PROBE, _RMS_PLANNED = (96, 3, 64), 148736


def layer_activation_bytes(cfg: ModelConfig, pg: ProcessGroups, micro_batch: int, vocab: int, *,
                           sequence_parallel: bool = False, dtype: torch.dtype = torch.bfloat16) -> int:
    """Saved bytes of one transformer layer: a 2-layer model's layers minus a 1-layer model's."""
    return int(bytes_per_layer(cfg, pg, micro_batch, vocab, sequence_parallel=sequence_parallel, dtype=dtype,
                               exclude_weights=True))


def dispatch_comm_bytes(pg: ProcessGroups) -> dict[tuple[str, str], int]:
    """Bytes this rank handed to MoE token-dispatch collectives so far, keyed (group kind, label) as
    ProcessGroups.comm_bytes counts them (labels moe_*; what planning/moe.py:dispatch_comm_bytes predicts)."""
    return {key: v for key, v in pg.comm_bytes.items() if key[1].startswith("moe_")}


def rms_norm_overcount(sh: RunShape) -> float:
    """Bytes per layer that the planner counts for its two RMSNorms but this torch's F.rms_norm does not
    keep (0 on the releases the term was measured on)."""
    if sh.cfg.model.normalization != "RMSNorm":
        return 0.0
    x = torch.randn(*_RMS_PROBE, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(_RMS_PROBE[-1], dtype=torch.bfloat16, requires_grad=True)
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.rms_norm(x, (_RMS_PROBE[-1],), w, 1e-5)
    per_channel = (_RMS_PLANNED - sum(kept.values())) / x.numel()
    return 2 * per_channel * sh.h * sh.local_tokens / (sh.tp if sh.sp else 1)
