"""Multi-token prediction's cost (--mtp-num-layers D, model/mtp.py): all on the last pipeline stage (the rank of
the loss), counted apart from the main model's parameters (DeepSeek-V3's published 671B leaves its MTP module
out) and added to what the stage holds and computes.

Per depth: three norms (enorm, hnorm, its final norm), eh_proj [h, 2h] (rows over TP), one transformer layer of
the main model's last layer's kind (dense or MoE, its routed experts in the expert family), and, on a last stage
without the embedding and untied output weights, one copy of the word embedding for all depths. Forward FLOPs
per token: the layer's, eh_proj's 2 x 2h x h, and the output head's again. Saved activations per micro-batch: the
layer's, the concatenated projection input (2h), the three norms' inputs and another set of logits.

The layer's own terms come from planning/memory.py and flops.py, which pass their functions in (this module
imports neither: they import it).
"""

from __future__ import annotations

from collections.abc import Callable

from megalite.config.model import ModelConfig
from megalite.planning import moe
from megalite.planning.model_shape import LayerShape, ModelShape
from megalite.planning.shape import RunShape


def last_kind(sh: RunShape) -> LayerShape:
    """The kind of every MTP layer: the main model's last layer's."""
    return sh.model_shape.layers[-1]


def embedding_copy_params(sh: RunShape) -> int:
    """The last stage's copy of the word embedding (PP > 1 with untied output weights; tied, the output layer's
    copy serves)."""
    m = sh.cfg.model
    return sh.padded_vocab // sh.tp * sh.h if m.mtp_depths and sh.pp > 1 and not m.tied_embeddings else 0


def dense_params(sh: RunShape, layer_params: Callable[[RunShape, LayerShape], int],
                 norm_params: Callable[[RunShape], int]) -> int:
    """The D depths' dense-buffer parameters on one TP rank of the last stage (with the embedding copy), from
    memory.py's ``layer_params`` and ``norm_params``."""
    m = sh.cfg.model
    if not m.mtp_depths:
        return 0
    depth = 3 * norm_params(sh) + (sh.h // sh.tp) * 2 * sh.h + layer_params(sh, last_kind(sh))
    return m.mtp_depths * depth + embedding_copy_params(sh)


def expert_params(sh: RunShape) -> int:
    """The D depths' routed experts on one rank (their layers are MoE when the last layer is)."""
    return sh.cfg.model.mtp_depths * moe.expert_params(sh) if last_kind(sh).moe else 0


def frozen_params(sh: RunShape) -> int:
    """The D depths' expert biases (MoE layers with --moe-router-enable-expert-bias)."""
    return sh.cfg.model.mtp_depths * moe.frozen_params(sh) if last_kind(sh).moe else 0


def all_params(sh: RunShape, layer_params: Callable[[RunShape, LayerShape], int],
               norm_params: Callable[[RunShape], int]) -> int:
    """Every MTP parameter on one rank of the last stage (unsplit for tp = pp = ep = 1: the MTP module's count)."""
    return dense_params(sh, layer_params, norm_params) + expert_params(sh) + frozen_params(sh)


def flops_per_token(cfg: ModelConfig, layer_flops: Callable[[LayerShape], float], output_flops: float) -> float:
    """Forward FLOPs per token of the D depths: each its layer (``layer_flops`` of a kind), eh_proj and the
    output head (``output_flops``)."""
    if not cfg.mtp_depths:
        return 0.0
    h = cfg.hidden_size
    return cfg.mtp_depths * (layer_flops(ModelShape.of(cfg).layers[-1]) + 2 * 2 * h * h + output_flops)


def activation_bytes(sh: RunShape, stage: int, layer_bytes: Callable[[RunShape, LayerShape], float],
                     logits: float) -> float:
    """Per micro-batch whose loss the last stage computes: each depth's layer (``layer_bytes`` of a kind),
    eh_proj's input [s, b, 2h] (gathered by the projection under SP), the norms' inputs and its ``logits``."""
    m = sh.cfg.model
    if not m.mtp_depths or stage != sh.loss_rank:
        return 0.0
    e, tokens = sh.act_bytes, sh.local_tokens
    sp = sh.tp if sh.sp else 1
    return m.mtp_depths * (layer_bytes(sh, last_kind(sh)) + tokens * 2 * sh.h * e + 3 * tokens * sh.h * e / sp
                           + logits)
