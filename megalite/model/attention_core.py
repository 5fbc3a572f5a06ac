"""The core attention call of one layer: the one-rank core or the layer's context-parallel variant.

Both attention modules (model/transformer.py's ``Attention`` and model/mla.py's ``MultiLatentAttention``)
hand their q [b, heads, s, d], k, v [b, groups, s, d] here, so every path (each --attention-backend, each
--cp-comm-type, sliding windows, soft-capping, packed documents, attention dropout) is chosen in one place.
"""

from __future__ import annotations

import contextlib

import torch

from megalite.attention import Documents, core_attention
from megalite.config.model import ModelConfig
from megalite.context_parallel import context_parallel_attention
from megalite.tensor_parallel.context import BuildContext


def layer_core(cfg: ModelConfig, ctx: BuildContext, cp_comm_type: str, window: int, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, p: float, documents: Documents | None = None) -> torch.Tensor:
    """Causal attention of q over k, v with dropout ``p`` (drawn from the TP-sharded RNG), this layer's
    ``window`` (0: none) and --cp-comm-type; ``documents``: the packed documents of the micro-batch."""
    softcap = cfg.attn_logit_softcapping or 0.0  # --attn-logit-softcapping: every path applies it
    with ctx.tracker.fork() if p > 0 else contextlib.nullcontext():
        if ctx.pg.cp_size > 1:  # this rank's two sequence chunks against the whole sequence's keys
            if window:  # the window travels with the documents (every CP variant cuts by them)
                documents = (documents or Documents.whole(q.shape[0], q.shape[2] * ctx.pg.cp_size)
                             ).with_window(window)
            return context_parallel_attention(q, k, v, ctx.pg, cp_comm_type, dropout_p=p, documents=documents,
                                              backend=cfg.attention_backend, softcap=softcap)
        return core_attention(q, k, v, p, cfg.attention_backend, documents, window, softcap)
