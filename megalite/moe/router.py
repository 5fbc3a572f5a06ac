"""The router: scores in fp32, top-k choice, capacity drop, and the load-balancing terms.

Every term is written so that the ranks holding parts of the same sequences (TP with sequence
parallelism, CP) each add their share and the shares sum to the single-process value: token counts are
summed over that group (``Group.TP_CP``) before they multiply the local probabilities, and means divide
by the whole sequences' token count. Formulas: docs/moe.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config.model import ModelConfig
from megalite.parallel.groups import Group
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.param_meta import declare_param
from megalite.tensor_parallel.sharding import ShardSpec


@dataclass
class Routing:
    """One micro-batch's routing of this rank's T tokens."""

    probs: torch.Tensor  # [T, k] fp32 weights of the chosen experts
    experts: torch.Tensor  # [T, k] int64 expert ids
    kept: torch.Tensor  # [T, k] bool: False where capacity dropped the assignment
    aux_loss: torch.Tensor | None  # load-balancing + z-loss terms of this rank's tokens (carries gradients)
    counts: torch.Tensor  # [E] fp32 assignments per expert among this rank's tokens, before any drop
    lb_loss: torch.Tensor | None = None  # the load-balancing part of aux_loss (this rank's share), detached
    z_loss: torch.Tensor | None = None  # the z-loss part, detached


def capacity(tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Most assignments an expert takes from one rank's ``tokens`` tokens."""
    return math.ceil(tokens * topk / num_experts * factor)


class _Pick(torch.autograd.Function):
    """``scores.gather(1, index)`` whose backward keeps only the index (gather's keeps ``scores`` too): top-k's
    own gradient, zeros with the grad scattered to the chosen entries."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(index)
        ctx.shape = scores.shape
        return scores.gather(1, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.shape).scatter(1, index, grad), None


def group_limited_topk(scores: torch.Tensor, k: int, num_groups: int, group_topk: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k among the experts of each token's ``group_topk`` best groups (Megatron-LM's rule): the E experts
    form ``num_groups`` equal groups of consecutive ids, a group's score is the sum of its top k // group_topk
    expert scores. Returns (the chosen scores [T, k], their expert ids [T, k]), as ``scores.topk(k)`` would.

    The choice is made without autograd and the values gathered: the gradient is topk's, and backward keeps
    only the [T, k] ids, as plain top-k does (the planner's router bytes hold for both)."""
    T, E = scores.shape
    with torch.no_grad():
        per_group = scores.view(T, num_groups, E // num_groups)
        group_scores = per_group.topk(k // group_topk, dim=-1).values.sum(-1)  # [T, G]
        chosen = group_scores.topk(group_topk, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)
        keep = keep.unsqueeze(-1).expand_as(per_group).reshape(T, E)
        experts = scores.masked_fill(~keep, float("-inf")).topk(k, dim=-1).indices
    return _Pick.apply(scores, experts), experts


def load_balancing_loss(scores: torch.Tensor, counts: torch.Tensor, tokens: int, topk: int, coeff: float
                        ) -> torch.Tensor:
    """Switch-transformer loss coeff * E / (k T^2) * sum_e (sum_t p_te) c_e, where c_e counts the T tokens'
    assignments to expert e (so with a uniform router it equals coeff). ``scores`` [.., E] may be a part of
    the T tokens whose counts ``counts`` covers in full."""
    E = scores.shape[-1]
    return coeff * E / (topk * tokens * tokens) * (scores.reshape(-1, E).sum(0) * counts).sum()


class Router(nn.Module):
    """Linear scores over the experts (weight [E, h], replicated), top-k and capacity."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext) -> None:
        super().__init__()
        self.cfg, self.pg = cfg, ctx.pg
        E, device = cfg.num_experts, ctx.device
        self.weight = nn.Parameter(torch.empty((E, cfg.hidden_size), dtype=ctx.dtype, device=device))
        # each TP rank routes its own sequence part: its weight gradient is a partial sum
        declare_param(self.weight, ShardSpec(partial_grad=ctx.sequence_parallel), (E, cfg.hidden_size), "normal")
        self.expert_bias: nn.Parameter | None = None
        if cfg.moe_router_enable_expert_bias:  # stored with the model; moved by the step, never by the optimizer
            self.expert_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32, device=device), requires_grad=False)
            declare_param(self.expert_bias, ShardSpec(), (E,), "zeros")

    def _topk(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, expert ids) [T, k]: plain top-k, or group-limited with --moe-router-group-topk."""
        c = self.cfg
        if c.moe_router_group_topk:
            return group_limited_topk(scores, c.moe_router_topk, c.moe_router_num_groups, c.moe_router_group_topk)
        return scores.topk(c.moe_router_topk, dim=-1)

    def _choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probs [T, k], experts [T, k], scores for the load-balancing loss [T, E])."""
        c, k = self.cfg, self.cfg.moe_router_topk
        if c.moe_router_score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            choice = scores if self.expert_bias is None else scores + self.expert_bias
            experts = self._topk(choice)[1]  # the bias moves the choice, never the weights
            probs = scores.gather(1, experts)
            if k > 1:
                probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
            aux_scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        elif c.moe_router_pre_softmax:
            scores = logits.softmax(-1)
            probs, experts = self._topk(scores)
            aux_scores = scores
        else:
            top, experts = self._topk(logits)
            probs = top.softmax(-1)
            aux_scores = logits.softmax(-1)
        if c.moe_router_topk_scaling_factor:
            probs = probs * c.moe_router_topk_scaling_factor
        return probs, experts, aux_scores

    def _drop(self, routed: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """[T, k] bool: the assignments within each expert's capacity (by probability or by position)."""
        c = self.cfg
        T = routed.shape[0]
        cap = capacity(T, c.moe_router_topk, c.num_experts, c.moe_expert_capacity_factor)
        if c.moe_token_drop_policy == "position":
            keep = routed & (routed.long().cumsum(0) <= cap)
        else:
            weights = torch.full_like(routed, -1.0, dtype=probs.dtype).scatter(1, experts, probs.detach())
            top = weights.topk(min(cap, T), dim=0).indices
            keep = torch.zeros_like(routed).scatter(0, top, True) & routed
        return keep.gather(1, experts)

    def forward(self, x: torch.Tensor) -> Routing:
        """``x`` [s, b, h]: this rank's part of the micro-batch's sequences."""
        c, pg = self.cfg, self.pg
        s, b, h = x.shape
        logits = F.linear(x.reshape(-1, h).float(), self.weight.float())  # [T, E] in fp32
        probs, experts, aux_scores = self._choose(logits)
        routed = torch.zeros_like(logits, dtype=torch.bool).scatter(1, experts, True)
        counts = routed.sum(0, dtype=torch.float32)
        kept = self._drop(routed, probs, experts) if c.moe_expert_capacity_factor is not None \
            else torch.ones_like(experts, dtype=torch.bool)
        parts = pg.size(Group.TP_CP)  # ranks holding parts of these sequences
        aux, lb, z = None, None, None
        if self.training and c.moe_aux_loss_coeff > 0 and c.moe_router_load_balancing_type != "none":
            if c.moe_router_load_balancing_type == "seq_aux_loss":  # per sequence, then the mean over b
                seq_counts = pg.all_reduce(routed.view(s, b, -1).sum(0, dtype=torch.float32), Group.TP_CP)
                per_seq = aux_scores.view(s, b, -1).sum(0) * seq_counts  # [b, E]
                E = c.num_experts
                aux = c.moe_aux_loss_coeff * E / (c.moe_router_topk * (s * parts) ** 2) * per_seq.sum() / b
            else:
                total = pg.all_reduce(counts.clone(), Group.TP_CP)
                aux = load_balancing_loss(aux_scores, total, s * b * parts, c.moe_router_topk, c.moe_aux_loss_coeff)
            lb = aux.detach()
        if self.training and c.moe_z_loss_coeff:  # evaluation and decoding need neither term
            zl = c.moe_z_loss_coeff * torch.logsumexp(logits, -1).square().sum() / (s * b * parts)
            z = zl.detach()
            aux = zl if aux is None else aux + zl
        return Routing(probs, experts, kept, aux, counts, lb, z)
