"""The MoE layer in place of a transformer layer's MLP: router -> dispatch -> experts -> combine
(+ shared expert). x [s, b, h] in and out (s/tp with sequence parallelism: every rank routes its own tokens).

The load-balancing and z-loss terms never reach the loss value: their gradient enters backward at this
layer's output (``_AttachAux``), scaled like the LM loss's (``LossScaling.aux_grad_scale``, docs/design.md
§3.9), which training hands over with ``set_loss_scaling``; pipeline stages without the loss get it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from megalite import compat
from megalite.config.model import ModelConfig
from megalite.moe.dispatch import make_dispatcher
from megalite.moe.experts import Experts
from megalite.moe.router import Router, Routing
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.param_meta import declare_param
from megalite.tensor_parallel.sharding import ShardSpec


class _AttachAux(torch.autograd.Function):
    """Identity on ``out``; in backward, ``aux`` receives the gradient ``layer.aux_grad_scale``."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, layer: "MoELayer") -> torch.Tensor:
        ctx.scale = layer.aux_grad_scale
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, torch.full((), ctx.scale, dtype=torch.float32, device=g.device), None


@dataclass
class MoEStats:
    """What one MoE layer routed on this rank since the counters were last read (training forwards only)."""

    counts: torch.Tensor  # [E] assignments per expert (before capacity drop), this logging window
    step_counts: torch.Tensor  # [E] the same for this step (the expert-bias update reads and clears it)
    lb_loss: torch.Tensor  # sum over micro-batches of this rank's share of the load-balancing loss
    z_loss: torch.Tensor
    dropped: torch.Tensor  # assignments capacity dropped
    microbatches: int = 0
    extra: dict = field(default_factory=dict)

    @classmethod
    def zeros(cls, num_experts: int, device: torch.device | None) -> "MoEStats":
        z = torch.zeros((), dtype=torch.float32, device=device)
        counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
        return cls(counts, counts.clone(), z, z.clone(), z.clone())

    def add(self, r: Routing) -> None:
        self.counts += r.counts
        self.step_counts += r.counts
        if r.lb_loss is not None:
            self.lb_loss += r.lb_loss
        if r.z_loss is not None:
            self.z_loss += r.z_loss
        self.dropped += (~r.kept).sum()
        self.microbatches += 1


class MoELayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: BuildContext, layer_number: int,
                 shared_expert: nn.Module | None = None) -> None:
        """``shared_expert``: the dense MLP every token also goes through (built by the caller, which owns MLP)."""
        super().__init__()
        pg, dtype, device = ctx.pg, ctx.dtype, ctx.device
        self.cfg, self.pg, self.layer_number = cfg, pg, layer_number
        self.router = Router(cfg, ctx)
        self.experts = Experts(cfg, ctx)
        self.shared_expert = shared_expert
        self.shared_expert_gate: nn.Parameter | None = None
        if shared_expert is not None and cfg.moe_shared_expert_gate:
            self.shared_expert_gate = nn.Parameter(torch.empty((1, cfg.hidden_size), dtype=dtype, device=device))
            declare_param(self.shared_expert_gate, ShardSpec(partial_grad=ctx.sequence_parallel), (1, cfg.hidden_size),
                          "normal")
        pad = cfg.moe_expert_capacity_factor if cfg.moe_pad_expert_input_to_capacity else None
        self.dispatcher = make_dispatcher(cfg.moe_token_dispatcher_type, cfg.num_experts, pg, cfg.moe_router_topk, pad)
        self.aux_grad_scale = 1.0
        self.stats = MoEStats.zeros(cfg.num_experts, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        routing = self.router(x)
        rows, counts, state = self.dispatcher.dispatch(x.reshape(-1, h), routing)
        out = self.dispatcher.combine(self.experts(rows, counts), state).view(s, b, h)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(F.linear(x, self.shared_expert_gate))
            out = out + shared
        if routing.aux_loss is not None:
            out = _AttachAux.apply(out, routing.aux_loss, self)
        if self.training and not compat.in_backward():  # not a recomputation in backward
            self.stats.add(routing)
        return out
