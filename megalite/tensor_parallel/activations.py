"""The MLP's activation of fc1's output, one function for the dense MLP and the experts.

A gated MLP (--swiglu, --geglu: megatron-core's gated_linear_unit) holds fc1 as [gate; up] stacked, and each
tensor-parallel rank keeps its slice of both halves (ShardSpec chunks=2), so the rank's own output splits in
two and the activation needs no communication.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite.config.model import ModelConfig


def mlp_activation(h: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """act(gate) * up for a gated MLP (SiLU for --swiglu, tanh-approximated GELU for --geglu), else GELU."""
    if not cfg.gated_linear_unit:
        return F.gelu(h)
    gate, up = h.chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") if cfg.geglu else F.silu(gate)) * up
