"""Multi-latent attention (--multi-latent-attention): DeepSeek-V2/V3's attention, as megatron-core builds it.

x [s, b, h] ->
  queries  q_down_proj -> q_layernorm -> q_up_proj (q_proj without --q-lora-rank) -> per head [q_nope; q_pe]
  keys     kv_down_proj -> [latent (--kv-lora-rank); k_pe (--qk-pos-emb-head-dim)], kv_layernorm(latent)
  (the two latent norms exist with --qk-layernorm, as in megatron-core's MLA layer: DeepSeek-V3 has them)
           -> kv_up_proj -> per head [k_nope (--qk-head-dim); v (--v-head-dim)]
  RoPE on each head's q_pe and on the one k_pe every head shares (their channels read as interleaved pairs,
  as megatron-core's MLA and DeepSeek's checkpoints rotate them); q = [q_nope; q_pe], k = [k_nope; k_pe];
  softmax(q.k (qk + pos dims)^-0.5 mscale^2) v -> proj (row-parallel) of heads x --v-head-dim.
Parameter names are megatron-core's without its ``linear_`` prefix (``proj`` is its linear_proj, as in the
standard attention), so a checkpoint mapping is a rename.

Tensor parallelism: the heads split over the ranks (q_up_proj / q_proj and kv_up_proj column-parallel, proj
row-parallel); the down-projections and their norms are replicated and run on the rank's input as it comes (its
sequence shard with --sequence-parallel, their gradients summed over TP then, as the norms' are:
tensor_parallel/replicated_linear.py). The latent reaches the heads through kv_up_proj's own input mapping;
the RoPE key through ``gather_from_sp`` (with SP) or ``copy_to_tp``, so its gradient sums every rank's heads.

The core attention: q and k are --qk-head-dim + --qk-pos-emb-head-dim wide, v --v-head-dim; v is zero-padded
to the q/k width (or q and k to v's, q rescaled) so that every core path (each backend, the blockwise
kernels, each context-parallel comm type, packed documents) runs unchanged on equal widths, and the padded
output channels are dropped. The core divides the scores by sqrt(width), so q carries the ratio to MLA's scale.

Decoding (model/gpt.py with a KV cache): the cache keeps per token only the normed latent and the rotated RoPE
key (``ModelConfig.mla_cache_channels``), on every TP rank; a step's queries read them directly, the key
up-projection folded into the query and the value up-projection applied to the output (``_decode``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megalite.attention import Documents
from megalite.config.model import ModelConfig
from megalite.model.attention_core import layer_core
from megalite.model.norm import Norm
from megalite.model.rope import apply_rope
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.tensor_parallel.mappings import copy_to_tp, gather_from_sp
from megalite.tensor_parallel.recompute import recompute
from megalite.tensor_parallel.replicated_linear import ReplicatedLinear


def mla_rope(x: torch.Tensor, angles: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """RoPE of MLA's rotated part x [s, b, heads, d] whose channels pair up as (0, 1), (2, 3), ...: the even
    channels then the odd ones, rotated as halves (megatron-core's MLA rotation, transformers' DeepSeek-V3
    rope_interleave). The output keeps the halves layout; q and k get the same, so their dot product is
    the interleaved one."""
    return apply_rope(torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1), angles, scale)


class MultiLatentAttention(nn.Module):
    """MLA with its heads split over TP; built in place of ``Attention`` by the layer (model/transformer.py)."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, layer_number: int = 0) -> None:
        """``layer_number``: the global (0-based) number, which picks this layer's --cp-comm-type."""
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        self.cp_comm_type = ctx.layer_cp_comm_type(layer_number)
        self.heads_local = cfg.num_attention_heads // ctx.pg.tp_size
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.dqk, self.dpos, self.dv, self.rank = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim, \
            cfg.kv_lora_rank
        dq = cfg.q_head_dim
        if cfg.q_lora:
            self.q_down_proj = ReplicatedLinear(h, cfg.q_lora_rank, ctx)
            self.q_layernorm = Norm(cfg, ctx, cfg.q_lora_rank) if cfg.qk_layernorm else nn.Identity()
            self.q_up_proj = ColumnParallelLinear(cfg.q_lora_rank, heads * dq, ctx, bias=False)
        else:
            self.q_proj = ColumnParallelLinear(h, heads * dq, ctx, bias=False)
        self.kv_down_proj = ReplicatedLinear(h, self.rank + self.dpos, ctx)
        self.kv_layernorm = Norm(cfg, ctx, self.rank) if cfg.qk_layernorm else nn.Identity()
        self.kv_up_proj = ColumnParallelLinear(self.rank, heads * (self.dqk + self.dv), ctx, bias=False)
        self.proj = RowParallelLinear(heads * self.dv, h, ctx, bias=cfg.add_bias_linear)
        # the width q, k and v enter the core with, and q's factor from the core's 1/sqrt(width) to MLA's scale
        self.width = max(dq, self.dv)
        factor = cfg.yarn_softmax_scale_multiplier * math.sqrt(self.width / dq)
        self.q_scale = None if factor == 1.0 else factor

    def _rope_key(self, k_pe: torch.Tensor) -> torch.Tensor:
        """The shared RoPE key of the whole sequence [s, b, d] (with SP it comes as the rank's shard); its
        gradient is the sum over every rank's heads."""
        if self.ctx.sequence_parallel:
            return gather_from_sp(k_pe, self.ctx.pg)
        return copy_to_tp(k_pe, self.ctx.pg)

    def _padded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v zero-padded to the core's common width (the padded channels add nothing to q.k and
        leave extra output channels, dropped after the core)."""
        if v.shape[-1] < self.width:
            v = F.pad(v, (0, self.width - v.shape[-1]))
        if q.shape[-1] < self.width:
            q, k = (F.pad(t, (0, self.width - t.shape[-1])) for t in (q, k))
        return q, k, v

    def forward(self, x: torch.Tensor, rope_angles: torch.Tensor, kv_cache=None,
                documents: Documents | None = None) -> torch.Tensor:
        """As ``Attention.forward`` (``rope_angles``: the model's one table, --qk-pos-emb-head-dim wide: MLA
        has no windowed layers and so no second kind); ``kv_cache.update(latent, k_pe)`` keeps [b, 1, s,
        --kv-lora-rank] and [b, 1, s, --qk-pos-emb-head-dim] per step and returns every position's so far."""
        cfg = self.cfg
        q = self.q_up_proj(self.q_layernorm(self.q_down_proj(x))) if cfg.q_lora else self.q_proj(x)
        s, b = q.shape[:2]
        q_nope, q_pe = q.view(s, b, self.heads_local, -1).split([self.dqk, self.dpos], dim=-1)
        latent, k_pe = self.kv_down_proj(x).split([self.rank, self.dpos], dim=-1)
        latent = self.kv_layernorm(latent)
        k_pe = self._rope_key(k_pe).unsqueeze(2)  # [s, b, 1, dpos]
        m = cfg.rope_attention_factor  # YaRN scales cos and sin; 1 otherwise
        q_pe, k_pe = mla_rope(q_pe, rope_angles, m), mla_rope(k_pe, rope_angles, m)
        if kv_cache is not None:
            cached, cached_pe = kv_cache.update(latent.transpose(0, 1).unsqueeze(1), k_pe.permute(1, 2, 0, 3))
            if cached.shape[2] > s:  # earlier positions are cached: attend from the latent
                return self.proj(self._decode(q_nope, q_pe, cached, cached_pe))
        k_nope, v = self.kv_up_proj(latent).view(s, b, self.heads_local, -1).split([self.dqk, self.dv], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        if self.q_scale is not None:
            q = q * self.q_scale
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.heads_local, -1)], dim=-1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in self._padded(q, k, v))  # [b, heads, s, width]
        p = cfg.attention_dropout if self.training else 0.0
        core = (self.cfg, self.ctx, self.cp_comm_type, 0)
        if cfg.recompute_granularity == "selective":  # the s^2 attention activations dominate memory
            out = recompute(lambda *a: layer_core(*core, *a), self.ctx.tracker, q, k, v, p, documents)
        else:
            out = layer_core(*core, q, k, v, p, documents)
        out = out[..., :self.dv].permute(2, 0, 1, 3).reshape(s, b, self.heads_local * self.dv)
        return self.proj(out)

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor
                ) -> torch.Tensor:
        """The step's queries q_nope, q_pe [s, b, heads, ·] against every cached position's latent [b, 1, t, r]
        and RoPE key [b, 1, t, dpos] (the last s are the step's own), without per-head keys or values:
        q_nope.(W_uk latent) = (q_nope W_uk).latent and the values' W_uv moves past the probabilities.
        Returns [s, b, heads * --v-head-dim]."""
        s, b, heads = q_nope.shape[:3]
        w = self.kv_up_proj.weight.view(heads, self.dqk + self.dv, self.rank)
        q_latent = torch.einsum("sbhd,hdr->bhsr", q_nope, w[:, :self.dqk])
        scores = q_latent @ latent.transpose(-1, -2) + q_pe.permute(1, 2, 0, 3) @ k_pe.transpose(-1, -2)
        scores = scores.float() * self.cfg.mla_softmax_scale()
        cap = self.cfg.attn_logit_softcapping
        if cap:
            scores = torch.tanh(scores / cap) * cap
        t = latent.shape[2]
        future = torch.ones(s, t, dtype=torch.bool, device=scores.device).triu(1 + t - s)
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1).to(latent.dtype)
        out = torch.einsum("bhsr,hvr->sbhv", probs @ latent, w[:, self.dqk:])
        return out.reshape(s, b, heads * self.dv)
