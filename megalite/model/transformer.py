"""One transformer layer built from tensor-parallel pieces.

x [s, b, h] -> x + dropout(proj(attention(qkv(norm(x))))) -> x + dropout(fc2(act(fc1(norm(x))))) (pre-norm,
the default); --sublayer-norms post: x + dropout(norm(proj(...qkv(x)))) and likewise for the MLP (OLMo 2),
pre-post: both. --qk-layernorm: q and k normalized after the QKV projection (model/qk_norm.py).
With sequence parallelism x is [s/tp, b, h]; the column-parallel GEMMs gather it and the row-parallel
ones reduce-scatter back.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megalite.attention import Documents
from megalite.config.model import ModelConfig
from megalite.model.attention_core import layer_core
from megalite.model.mla import MultiLatentAttention
from megalite.model.norm import Norm
from megalite.model.qk_norm import apply_qk_norms, qk_norms
from megalite.model.rope import KindAngles, apply_rope, layer_angles
from megalite.moe.layer import MoELayer
from megalite.tensor_parallel.activations import mlp_activation
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.tensor_parallel.param_meta import amend_param
from megalite.tensor_parallel.random import hidden_dropout
from megalite.tensor_parallel.recompute import recompute
from megalite.tensor_parallel.sharding import QKVShardSpec, ShardSpec


class Attention(nn.Module):
    """Self-attention with one fused QKV GEMM in Megatron's per-group layout, heads split over TP."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, layer_number: int = 0) -> None:
        """``layer_number``: the global (0-based) number, which picks this layer's --cp-comm-type."""
        super().__init__()
        tp = ctx.pg.tp_size
        self.cfg, self.ctx = cfg, ctx
        self.cp_comm_type = ctx.layer_cp_comm_type(layer_number)
        # --window-size: the keys a query sees (itself included) in this layer, 0 for full causal attention
        self.window = cfg.attention_windows()[layer_number]
        self.head_dim = cfg.kv_channels
        groups = cfg.num_query_groups
        # with fewer query groups than TP ranks each rank keeps a replica of its group's K/V (validation counts
        # the heads by the same function)
        self.heads_local, self.groups_local = cfg.heads_per_tp_rank(tp)
        self.q_per_group = self.heads_local // self.groups_local
        spec = QKVShardSpec(dim=0, heads=cfg.num_attention_heads, groups=groups, head_dim=self.head_dim)
        out_full = (cfg.num_attention_heads + 2 * groups) * self.head_dim
        out_local = (self.heads_local + 2 * self.groups_local) * self.head_dim
        self.qkv = ColumnParallelLinear(cfg.hidden_size, out_local * tp, ctx,
                                        bias=cfg.add_bias_linear or cfg.add_qkv_bias, spec=spec)
        # The layer was sized for out_local * tp rows; record the true full shape of the fused layout.
        amend_param(self.qkv.weight, full_shape=(out_full, cfg.hidden_size))
        if self.qkv.bias is not None:
            amend_param(self.qkv.bias, full_shape=(out_full,))
        self.proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, ctx,
                                      bias=cfg.add_bias_linear)
        # --qk-layernorm: q and k normalized per head or over the projection (model/qk_norm.py)
        if cfg.qk_layernorm:
            self.q_norm, self.k_norm = qk_norms(cfg, ctx, self.heads_local, self.groups_local)
        self.qk_layernorm = cfg.qk_layernorm
        # --softmax-scale: every core scales the scores by 1/sqrt(d), so q is scaled by the ratio, which holds
        # on every path (each attention backend, context parallelism, decoding) and before any logit cap
        self.q_scale = None if cfg.softmax_scale is None else cfg.softmax_scale * math.sqrt(self.head_dim)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float,
              documents: Documents | None = None) -> torch.Tensor:
        return layer_core(self.cfg, self.ctx, self.cp_comm_type, self.window, q, k, v, p, documents)

    def forward(self, x: torch.Tensor, rope_angles: torch.Tensor | KindAngles | None, kv_cache=None,
                documents: Documents | None = None) -> torch.Tensor:
        """``rope_angles``: this layer's, or both kinds' (``KindAngles``: it picks by its window).
        ``kv_cache`` (inference): an object whose ``update(k, v)`` appends this step's keys and values
        [b, groups_local, s, d] and returns all of them so far (see megalite/inference/kv_cache.py).
        ``documents``: the packed documents of the micro-batch's sequences (attention stays inside each)."""
        qkv = self.qkv(x)  # [s, b, groups_local * (q_per_group + 2) * d]
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.groups_local, self.q_per_group + 2, self.head_dim)
        # One split (its backward is a single concat) rather than slice + two selects (each of whose
        # backwards zero-fills a full qkv-sized buffer that is then summed).
        q, k, v = qkv.split([self.q_per_group, 1, 1], dim=3)
        q = q.reshape(s, b, self.heads_local, self.head_dim)  # a view when q_per_group == 1
        k, v = k.squeeze(3), v.squeeze(3)  # [s, b, groups_local, d]
        if self.qk_layernorm:
            q, k = apply_qk_norms(q, k, self.q_norm, self.k_norm)
        rope_angles = layer_angles(rope_angles, self.window)  # --rotary-base-local: the windowed layers' own
        if rope_angles is not None:
            m = self.cfg.rope_attention_factor  # YaRN scales cos and sin; 1 otherwise
            q, k = apply_rope(q, rope_angles, m), apply_rope(k, rope_angles, m)
        if self.q_scale is not None:
            q = q * self.q_scale
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        if kv_cache is not None:
            k, v = kv_cache.update(k, v, self.window)  # [b, groups_local, past + s, d] (past: within the window)
        p = self.cfg.attention_dropout if self.training else 0.0
        if self.cfg.recompute_granularity == "selective":  # the s^2 attention activations dominate memory
            out = recompute(self._core, self.ctx.tracker, q, k, v, p, documents)
        else:
            out = self._core(q, k, v, p, documents)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * self.head_dim)
        return self.proj(out)


class MLP(nn.Module):
    """fc1 (column-parallel) -> GeLU, SwiGLU or GeGLU -> fc2 (row-parallel)."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, ffn_hidden_size: int | None = None) -> None:
        """``ffn_hidden_size``: this instance's width when it is not --ffn-hidden-size (the shared expert)."""
        super().__init__()
        self.cfg = cfg
        ffn = ffn_hidden_size or cfg.ffn_hidden_size
        gated = cfg.gated_linear_unit
        # A gated MLP's fc1 is [gate; up] stacked; each rank keeps its slice of both halves.
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, 2 * ffn if gated else ffn, ctx,
                                        bias=cfg.add_bias_linear, spec=ShardSpec(dim=0, chunks=2 if gated else 1))
        self.fc2 = RowParallelLinear(ffn, cfg.hidden_size, ctx, bias=cfg.add_bias_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(mlp_activation(self.fc1(x), self.cfg))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: BuildContext, layer_number: int = 0) -> None:
        """``layer_number``: the global (0-based) number, which picks an MoE or a dense MLP and the
        attention's --cp-comm-type."""
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        # --sublayer-norms: 'pre' norms each sublayer's input, 'post' its output before the residual add
        pre, post = cfg.sublayer_norms in ("pre", "pre-post"), cfg.sublayer_norms in ("post", "pre-post")
        self.input_norm = Norm(cfg, ctx) if pre else nn.Identity()
        # --multi-latent-attention: MLA's latent projections in place of the fused QKV (model/mla.py)
        self.attention = (MultiLatentAttention if cfg.multi_latent_attention else Attention)(cfg, ctx, layer_number)
        self.post_attention_norm = Norm(cfg, ctx) if post else nn.Identity()
        self.pre_mlp_norm = Norm(cfg, ctx) if pre else nn.Identity()
        if cfg.is_moe and cfg.moe_layers()[layer_number]:
            shared = cfg.moe_shared_expert_intermediate_size
            self.mlp = MoELayer(cfg, ctx, layer_number, MLP(cfg, ctx, shared) if shared else None)
        else:
            self.mlp = MLP(cfg, ctx)
        self.post_mlp_norm = Norm(cfg, ctx) if post else nn.Identity()

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return hidden_dropout(x, self.cfg.hidden_dropout if self.training else 0.0, self.ctx.tracker,
                              self.ctx.sequence_parallel)

    def forward(self, x: torch.Tensor, rope_angles: torch.Tensor | None = None, kv_cache=None,
                documents: Documents | None = None) -> torch.Tensor:
        attn = self.attention(self.input_norm(x), rope_angles, kv_cache, documents)
        x = x + self._dropout(self.post_attention_norm(attn))
        return x + self._dropout(self.post_mlp_norm(self.mlp(self.pre_mlp_norm(x))))
