"""A megalite checkpoint written in Megatron-LM's legacy ``torch`` format at a chosen TP x PP: the
inverse of megatron_legacy.py's merge.

One ``mp_rank_TT[_PPP]/model_optim_rng.pt`` per (TP rank, PP rank), torch.save'd as Megatron-LM's
training loop saves it: ``model`` (the rank's state dict under the names of megatron-core's local layer
spec, layer numbers local to the stage), ``args``, ``iteration``, ``checkpoint_version``. The legacy
format is read back at the layout it was written at (Megatron-LM does not reshard it), so the TP x PP is
chosen here:

- column-parallel tensors (word embedding and output rows, QKV and fc1 with their biases) are cut on
  dim 0 — QKV in whole KV groups, which megalite's per-group row order already is —, SwiGLU's fc1 as
  [gate_r; up_r] per rank; row-parallel weights (proj, fc2) on dim 1; all else replicated;
- layers split evenly over the stages; the embedding on the first stage, the final norm and output
  layer on the last (a tied model's last stage holds the embedding as ``output_layer.weight``, as
  megatron-core's GPTModel does).

No optimizer or RNG state is written (Megatron-LM then needs ``--no-load-optim --no-load-rng`` or
``--finetune``); routed experts are not exported.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.megatron_export import (
    CHECKPOINT_VERSION,
    EXTRA_STATE,
    export_vocab,
    megatron_args,
    megatron_tensors,
)
from megalite.checkpointing.megatron_legacy import COLUMN, FILE, ROW
from megalite.checkpointing.metadata import model_config
from megalite.checkpointing.paths import TRACKER, iter_dirname
from megalite.config.model import ModelConfig
from megalite.config.validate import layout_errors

# torch_dist's fused norm names -> the local spec's own state-dict names
LOCAL_NORMS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
               "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
               "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
               "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}


def tp_shard(key: str, t: torch.Tensor, tp: int, rank: int, swiglu: bool) -> torch.Tensor:
    """TP rank ``rank``'s piece of the full tensor ``t`` under megatron-core name ``key``."""
    if tp == 1:
        return t
    if ROW.search(key):
        dim = 1
    elif COLUMN.search(key):
        dim = 0
    else:
        return t
    if t.shape[dim] % tp:
        raise CheckpointError(f"to-megatron: {key} of shape {tuple(t.shape)} does not split over TP={tp}")
    if swiglu and "linear_fc1" in key:
        gate, up = t.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]]).clone()
    return t.chunk(tp, dim=dim)[rank].clone()


def legacy_layout_errors(cfg: ModelConfig, tp: int, pp: int) -> list[str]:
    """Why the model cannot be cut into Megatron-LM's TP x PP (empty when it can): the training flags'
    own layout rules, and Megatron-LM's stricter one on KV groups: each TP rank holds whole groups (no
    replication of a group over ranks), or a group's K/V rows would be cut between two ranks' files."""
    errors = layout_errors(cfg, tp, pp)
    groups = cfg.num_query_groups or cfg.num_attention_heads
    if groups % tp:
        errors.append(f"--tensor-model-parallel-size ({tp}) must divide --num-query-groups ({groups}): Megatron-LM "
                      "gives each TP rank whole KV groups")
    return errors


def stage_state(full: dict[str, torch.Tensor], num_layers: int, pp: int, stage: int,
                tied: bool) -> dict[str, torch.Tensor | None]:
    """The full tensors stage ``stage`` holds, per-layer local-spec names numbered from 0 on the stage."""
    per = num_layers // pp
    out: dict[str, torch.Tensor | None] = {}
    for key, t in full.items():
        if key.startswith("decoder.layers."):
            suffix = key.removeprefix("decoder.layers.")
            for i in range(per):
                out[f"decoder.layers.{i}.{LOCAL_NORMS.get(suffix, suffix)}"] = t[stage * per + i]
                for module in EXTRA_STATE:  # the linears' (empty) extra state: a strict load asks for it
                    out[f"decoder.layers.{i}.{module}._extra_state"] = None
        elif key.startswith("embedding."):
            if stage == 0:
                out[key] = t
            if tied and stage == pp - 1 and key == "embedding.word_embeddings.weight" and pp > 1:
                out["output_layer.weight"] = t
        elif stage == pp - 1:
            out[key] = t
    return out


def save_legacy(folder: str, config: dict[str, Any], get: Callable[[str], torch.Tensor], iteration: int, *,
                tp: int, pp: int, padded_vocab: int | None = None, dtype: torch.dtype | None = None) -> str:
    """Write ``folder``/latest_checkpointed_iteration.txt and ``folder``/iter_XXXXXXX/mp_rank_*/; returns
    the iteration folder. ``padded_vocab``: embedding rows (default: Megatron-LM's padding for ``tp``)."""
    cfg, _ = model_config(config)
    padded_vocab = export_vocab(config, padded_vocab, tp)
    errors = legacy_layout_errors(cfg, tp, pp)
    if padded_vocab % tp:
        errors.append(f"{padded_vocab} embedding rows do not split over --tensor-model-parallel-size {tp}")
    if errors:
        raise CheckpointError("to-megatron --format torch: " + "; ".join(errors))
    full = megatron_tensors(config, get, padded_vocab, dtype)
    args = megatron_args(config, padded_vocab)
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.ckpt_format = tp, pp, "torch"
    it_dir = os.path.join(folder, iter_dirname(iteration))
    for stage in range(pp):
        held = stage_state(full, cfg.num_layers, pp, stage, cfg.tied_embeddings)
        for rank in range(tp):
            rank_dir = f"mp_rank_{rank:02d}" + (f"_{stage:03d}" if pp > 1 else "")
            model = {k: t if t is None else tp_shard(k, t, tp, rank, cfg.swiglu) for k, t in held.items()}
            os.makedirs(os.path.join(it_dir, rank_dir), exist_ok=True)
            torch.save({"model": model, "args": args, "iteration": iteration,
                        "checkpoint_version": CHECKPOINT_VERSION}, os.path.join(it_dir, rank_dir, FILE))
    with open(os.path.join(folder, TRACKER), "w") as f:
        f.write(str(iteration))
    return it_dir
