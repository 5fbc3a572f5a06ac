"""Multi-token prediction's cost (--mtp-num-layers D, model/mtp.py): all on the last pipeline stage (the rank of
the loss), counted apart from the main model's parameters (DeepSeek-V3's published 671B leaves its MTP module
out) and added to what the stage holds and computes.

Per depth: three norms (enorm, hnorm, its final norm), eh_proj [h, 2h] (rows over TP), one transformer layer of
the main model's last layer's kind (dense or MoE, its routed experts in the expert family), and, on a last stage
without the embedding and untied output weights, one copy of the word embedding for all depths. Forward FLOPs
per token: the layer's, eh_proj's 2 x 2h x h, and the output head's again. Saved activations per micro-batch: the
layer's, the concatenated projection input (2h), the three norms' inputs and another set of logits.
"""

from __future__ import annotations

from megalite.config.model import ModelConfig
from megalite.planning.model_shape import LayerShape, ModelShape
from megalite.planning.shape import RunShape


def _last_kind(sh: RunShape) -> LayerShape:
    return sh.model_shape.layers[-1]


def embedding_copy_params(sh: RunShape) -> int:
    """The last stage's copy of the word embedding (PP > 1 with untied output weights; tied, the output layer's
    copy serves)."""
    m = sh.cfg.model
    return sh.padded_vocab // sh.tp * sh.h if m.mtp_depths and sh.pp > 1 and not m.tied_embeddings else 0


def dense_params(sh: RunShape) -> int:
    """The D depths' dense-buffer parameters on one TP rank of the last stage (with the embedding copy)."""
    from megalite.planning.memory import layer_params, norm_params

    m = sh.cfg.model
    if not m.mtp_depths:
        return 0
    depth = 3 * norm_params(sh) + (sh.h // sh.tp) * 2 * sh.h + layer_params(sh, _last_kind(sh))
    return m.mtp_depths * depth + embedding_copy_params(sh)


def expert_params(sh: RunShape) -> int:
    """The D depths' routed experts on one rank (their layers are MoE when the last layer is)."""
    from megalite.planning.moe import expert_params as per_layer

    return sh.cfg.model.mtp_depths * per_layer(sh) if _last_kind(sh).moe else 0


def frozen_params(sh: RunShape) -> int:
    from megalite.planning.moe import frozen_params as per_layer

    return sh.cfg.model.mtp_depths * per_layer(sh) if _last_kind(sh).moe else 0


def all_params(sh: RunShape) -> int:
    """Every MTP parameter on one rank of the last stage (unsplit for tp = pp = ep = 1: the MTP module's count)."""
    return dense_params(sh) + expert_params(sh) + frozen_params(sh)


def flops_per_token(cfg: ModelConfig, vocab_size: int, seq_length: int) -> float:
    """Forward FLOPs per token of the D depths: each its layer, eh_proj and the output head."""
    from megalite.planning.flops import layer_flops_per_token, output_flops_per_token

    if not cfg.mtp_depths:
        return 0.0
    last = ModelShape.of(cfg).layers[-1]
    h = cfg.hidden_size
    per_depth = layer_flops_per_token(cfg, seq_length, last) + 2 * 2 * h * h + output_flops_per_token(cfg, vocab_size)
    return cfg.mtp_depths * per_depth


def activation_bytes(sh: RunShape, stage: int) -> float:
    """Per micro-batch whose loss the last stage computes: each depth's layer, eh_proj's input [s, b, 2h] (not
    split by SP: the projection gathers it), the norms' inputs and its logits."""
    from megalite.planning.memory import full_layer_bytes, logits_bytes

    m = sh.cfg.model
    if not m.mtp_depths or stage != sh.loss_rank:
        return 0.0
    e, tokens = sh.act_bytes, sh.local_tokens
    sp = sh.tp if sh.sp else 1
    per_depth = (full_layer_bytes(sh, _last_kind(sh)) + tokens * 2 * sh.h * e + 3 * tokens * sh.h * e / sp
                 + logits_bytes(sh, stage))
    return m.mtp_depths * per_depth
