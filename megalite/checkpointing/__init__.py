"""Sharded checkpoints: atomic save, safe load into any layout, Hugging Face conversion.

Directory layout (Megatron-like, documented in docs/checkpoints.md):

    SAVE/latest_checkpointed_iteration.txt        the last complete iteration, e.g. "100"
    SAVE/iter_0000100/metadata.json               config, layout, iteration, consumed samples
    SAVE/iter_0000100/mp_rank_TT_PPP/model.safetensors         weights of TP rank TT, PP rank PPP
    SAVE/iter_0000100/mp_rank_TT_PPP/optim_dp_DDD.safetensors  fp32 main params + Adam moments of the
                                                               flat slices DP rank DDD owns
    SAVE/iter_0000100/expert_rank_TT_EEE_PPP/{model,optim_dp_DDD}.safetensors   MoE: routed experts of
                                                  expert-TP rank TT, EP rank EEE (DDD: expert-DP rank)
    SAVE/iter_0000100/rng/rank_RRRRR.safetensors  RNG states of each global rank

Tensor names are layout-free (``layers.7.mlp.fc1.weight``); each ShardSpec rebuilds full tensors from
TP shards and cuts them for another layout, so any checkpoint loads into any valid layout.
"""

from megalite.checkpointing.load import CheckpointMismatch, load_checkpoint
from megalite.checkpointing.save import save_checkpoint

__all__ = ["CheckpointMismatch", "load_checkpoint", "save_checkpoint"]
