"""Norms on queries and keys (--qk-layernorm), applied after the QKV projection and before RoPE.

Two scopes (--qk-layernorm-scope):

- ``head`` (Megatron-LM's --qk-layernorm; Qwen3, Gemma 3): one norm of width head_dim applied to every
  head, its weight shared by the heads. Under TP each rank holds some heads, so each rank's weight
  gradient is a partial sum over its heads: summed over TP before the step (``partial_grad``).
- ``projection`` (OLMo 2): an RMSNorm over the whole q projection (heads x head_dim) and one over the whole
  k projection (groups x head_dim), with a weight per channel. Under TP a rank holds a slice of the
  projection, so the sum of squares spans the ranks: one all-reduce in forward, q's and k's sums together
  (and, since every rank's output depends on every rank's input, one in backward). Its weight is cut like
  the projection's rows: the q weight contiguously, the k weight by KV group, replicated like the K rows
  when TP exceeds the groups (``GroupRowsShardSpec``). With replicated groups each group's squares enter
  the sum once per replica and the count is multiplied alike, so the mean is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config.model import ModelConfig
from megalite.model.norm import Norm
from megalite.parallel.groups import Group, ProcessGroups
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.mappings import copy_to_tp, reduce_from_tp
from megalite.tensor_parallel.param_meta import declare_param
from megalite.tensor_parallel.sharding import ShardSpec, _numel


@dataclass(frozen=True)
class GroupRowsShardSpec(ShardSpec):
    """Rows laid out like the K (or V) rows of the fused QKV projection: ``groups`` equal blocks. With
    groups >= TP each rank holds whole groups (a contiguous split); with groups < TP the TP / groups ranks
    sharing a group each hold a copy, whose partial gradients ``finalize_grad`` sums and which counts once
    in the grad norm (as QKVShardSpec does for the K/V rows)."""

    groups: int = 0

    def _replicas(self, size: int) -> int:
        return size // self.groups if size > self.groups else 1

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        if size <= self.groups:
            return full.chunk(size, dim=0)[rank].clone()
        return full.chunk(self.groups, dim=0)[rank // self._replicas(size)].clone()

    def unshard(self, parts: list[torch.Tensor]) -> torch.Tensor:
        rep = self._replicas(len(parts))
        return torch.cat(parts[::rep], dim=0)

    def counted_ranges(self, shape: tuple[int, ...], rank: int, size: int) -> list[tuple[int, int]]:
        return [(0, _numel(shape))] if rank % self._replicas(size) == 0 else []

    def finalize_grad(self, grad: torch.Tensor, pg: ProcessGroups) -> None:
        rep = self._replicas(pg.tp_size)
        if rep == 1:
            return
        slots = grad.new_zeros((self.groups, *grad.shape))
        group = pg.tp_rank // rep
        slots[group] = grad
        pg.all_reduce(slots, Group.TP)
        grad.copy_(slots[group])


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole projection cut over TP (module doc): this rank's ``local`` channels of ``full``."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, full: int, local: int, spec: ShardSpec) -> None:
        super().__init__()
        self.pg, self.eps, self.local, self.zero_centered = ctx.pg, cfg.norm_epsilon, local, cfg.apply_layernorm_1p
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = nn.Parameter(init(local, dtype=ctx.dtype, device=ctx.device))
        declare_param(self.weight, spec, (full,), "zeros" if self.zero_centered else "ones")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s, b, n, d] (this rank's n heads) -> normalized by the root mean square over every rank's
        heads (module doc)."""
        flat = x.flatten(-2)
        if self.pg.tp_size == 1:
            weight = self.weight + 1 if self.zero_centered else self.weight
            return F.rms_norm(flat, (self.local,), weight, self.eps).view_as(x)
        xf = flat.float()
        return self.scale(x, xf, reduce_from_tp(copy_to_tp(xf.pow(2).sum(-1, keepdim=True), self.pg), self.pg))

    def scale(self, x: torch.Tensor, xf: torch.Tensor, squares: torch.Tensor) -> torch.Tensor:
        """x normalized, given ``xf`` (x flattened over its heads, fp32) and every rank's sum of squares."""
        weight = self.weight + 1 if self.zero_centered else self.weight
        out = (xf * torch.rsqrt(squares / (self.local * self.pg.tp_size) + self.eps)).to(x.dtype) * weight
        return out.view_as(x)


def apply_qk_norms(q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k normalized. Over the projection under TP, q's and k's sums of squares travel in one
    all-reduce (one per layer, not one per norm)."""
    if not isinstance(q_norm, ProjectionRMSNorm) or q_norm.pg.tp_size == 1:
        return q_norm(q), k_norm(k)
    qf, kf = q.flatten(-2).float(), k.flatten(-2).float()
    sums = torch.cat([qf.pow(2).sum(-1, keepdim=True), kf.pow(2).sum(-1, keepdim=True)], dim=-1)
    sums = reduce_from_tp(copy_to_tp(sums, q_norm.pg), q_norm.pg)
    return q_norm.scale(q, qf, sums[..., :1]), k_norm.scale(k, kf, sums[..., 1:])


def qk_norms(cfg: ModelConfig, ctx: BuildContext, heads_local: int, groups_local: int) -> tuple[nn.Module, nn.Module]:
    """The (q, k) norms of one attention layer (module doc); each maps this rank's [s, b, n, d] to the same."""
    d, tp = cfg.kv_channels, ctx.pg.tp_size
    if cfg.qk_layernorm_scope == "head":
        return Norm(cfg, ctx, size=d, partial_grad=tp > 1), Norm(cfg, ctx, size=d, partial_grad=tp > 1)
    groups = cfg.num_query_groups or cfg.num_attention_heads
    return (ProjectionRMSNorm(cfg, ctx, cfg.num_attention_heads * d, heads_local * d, ShardSpec(dim=0)),
            ProjectionRMSNorm(cfg, ctx, groups * d, groups_local * d, GroupRowsShardSpec(dim=0, groups=groups)))
