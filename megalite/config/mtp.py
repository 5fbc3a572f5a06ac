"""Multi-token prediction flags (Megatron-LM's --mtp-num-layers and --mtp-loss-scaling-factor), part of the model
section, with their rules.

MTP (DeepSeek-V3) adds D sequential modules on the last pipeline stage: module k combines the previous depth's
hidden states (the main model's final-normed output for k = 1) with the embedding of the tokens k ahead and runs
one more transformer layer, whose output the shared output head turns into a prediction of the token k + 1
ahead (model/mtp.py). Its losses, averaged over the depths and times the scaling factor, add to the gradient
but not to the reported lm loss; each depth's loss is logged as "mtp_k loss" (Megatron-LM's names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megalite.config.domain import Domain, size
from megalite.config.flags import option

MAX_MTP_LAYERS = 64


@dataclass(kw_only=True)
class MTPFields:
    """MTP's options; the scaling factor acts only with --mtp-num-layers."""

    mtp_num_layers: int | None = option(
        None, help="Multi-token prediction (DeepSeek-V3): this many extra depths on the last pipeline stage, each "
        "norms of the previous hidden states and of the embedding of the tokens one further ahead, a projection "
        "of their concatenation [embedding; hidden], one transformer layer of the last layer's kind and its own "
        "final norm, then the shared output head, predicting the token 1 + depth ahead. Default: none.",
        domain=size(MAX_MTP_LAYERS))
    mtp_loss_scaling_factor: float = option(
        0.1, help="With --mtp-num-layers: the MTP losses' weight; each depth's loss gets factor / "
        "--mtp-num-layers in the gradient (Megatron-LM's rule); the reported lm loss leaves them out.",
        domain=Domain(lo=0.0))

    @property
    def mtp_depths(self) -> int:
        """The number of MTP modules (0 without --mtp-num-layers)."""
        return self.mtp_num_layers or 0


MTP_DEFAULTS = {f: MTPFields.__dataclass_fields__[f].default for f in MTPFields.__dataclass_fields__}


def mtp_errors(m: Any) -> list[str]:
    """MTP's model rules: the factor only with it; with it, rotary positions (the last stage's embedding copy holds
    the word table only)."""
    if not m.mtp_num_layers:
        return ["--mtp-loss-scaling-factor needs --mtp-num-layers"] \
            if m.mtp_loss_scaling_factor != MTP_DEFAULTS["mtp_loss_scaling_factor"] else []
    if not m.rotary:
        return [f"--mtp-num-layers needs --position-embedding-type rope or yarn (got {m.position_embedding_type}): "
                "the MTP embedding on the last pipeline stage copies the word table only"]
    return []
