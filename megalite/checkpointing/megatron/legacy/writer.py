"""A megalite checkpoint written in Megatron-LM's legacy ``torch`` format at a chosen TP x PP: the
inverse of legacy/reader.py's merge.

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

Routed experts are written as SequentialMLP's ``local_experts.{j}`` (each expert's fc1/fc2 cut over TP
like the dense MLP's), split over ``ep`` expert-parallel ranks into ``mp_rank_TT[_PPP]_EEE`` folders (the
EP suffix only when EP > 1, as Megatron-LM names them), every non-expert tensor repeated in each EP rank's
file. No optimizer or RNG state is written (Megatron-LM then needs ``--no-load-optim --no-load-rng`` or
``--finetune``).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

import torch

from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.megatron.export import (
    CHECKPOINT_VERSION,
    EXPERTS,
    export_vocab,
    layer_linears,
    megatron_args,
    megatron_layers,
    mtp_experts,
    mtp_linears,
)
from megalite.checkpointing.megatron.legacy.reader import FILE
from megalite.checkpointing.megatron.tp import tp_shard
from megalite.checkpointing.metadata import model_config
from megalite.checkpointing.paths import TRACKER, iter_dirname
from megalite.config.model import ModelConfig
from megalite.config.validate import layout_errors

# torch_dist's fused norm names -> the local spec's own state-dict names
LOCAL_NORMS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
               "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
               "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
               "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
# SequentialMLP's sharded (stacked) expert keys -> one expert's own suffix under local_experts.{j}
EXPERT_SUFFIXES = {v: v.removeprefix("mlp.experts.experts.") for v in EXPERTS.values()}


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


def stage_state(top: dict[str, torch.Tensor], layers: list[dict[str, torch.Tensor]], pp: int, stage: int,
                tied: bool, ep: int = 1, ep_rank: int = 0) -> dict[str, torch.Tensor | None]:
    """The full tensors stage ``stage`` (and EP rank ``ep_rank``) holds under the local spec's names,
    layers numbered from 0 on the stage, routed experts one key pair per local expert numbered from 0."""
    per = len(layers) // pp
    out: dict[str, torch.Tensor | None] = {}
    for i, layer in enumerate(layers[stage * per:(stage + 1) * per]):
        for suffix, t in layer.items():
            if suffix in EXPERT_SUFFIXES:
                local = t.shape[0] // ep
                for j in range(local):
                    out[f"decoder.layers.{i}.mlp.experts.local_experts.{j}.{EXPERT_SUFFIXES[suffix]}"] = \
                        t[ep_rank * local + j]
            else:
                out[f"decoder.layers.{i}.{LOCAL_NORMS.get(suffix, suffix)}"] = t
        for module in layer_linears(layer):  # the linears' (empty) extra state: a strict load asks for it
            out[f"decoder.layers.{i}.{module}._extra_state"] = None
        for j in range(_experts(layer) // ep):
            for fc in ("linear_fc1", "linear_fc2"):
                out[f"decoder.layers.{i}.mlp.experts.local_experts.{j}.{fc}._extra_state"] = None
    for key, t in top.items():
        if key.startswith("embedding."):
            if stage == 0:
                out[key] = t
            if tied and stage == pp - 1 and key == "embedding.word_embeddings.weight" and pp > 1:
                out["output_layer.weight"] = t
        elif stage == pp - 1 and key.startswith("mtp."):  # a depth's layer: its norms unfused, as above
            prefix, mid, suffix = key.partition(".transformer_layer.")
            if mid and suffix in EXPERT_SUFFIXES:  # an MoE depth's experts: as a main-model layer's
                local = t.shape[0] // ep
                out.update({f"{prefix}{mid}mlp.experts.local_experts.{j}.{EXPERT_SUFFIXES[suffix]}":
                            t[ep_rank * local + j] for j in range(local)})
            else:
                out[f"{prefix}{mid}{LOCAL_NORMS.get(suffix, suffix)}" if mid else key] = t
        elif stage == pp - 1:
            out[key] = t
    if stage == pp - 1:
        out.update({f"{m}._extra_state": None for m in mtp_linears(top)})
        out.update({f"{prefix}.mlp.experts.local_experts.{j}.{fc}._extra_state": None
                    for prefix, experts in mtp_experts(top).items() for j in range(experts // ep)
                    for fc in ("linear_fc1", "linear_fc2")})
    return out


def _experts(layer: dict[str, torch.Tensor]) -> int:
    fc1 = layer.get(EXPERTS["mlp.experts.fc1_weight"])
    return 0 if fc1 is None else fc1.shape[0]


def save_legacy(folder: str, config: dict[str, Any], get: Callable[[str], torch.Tensor], iteration: int, *,
                tp: int, pp: int, ep: int = 1, padded_vocab: int | None = None,
                dtype: torch.dtype | None = None) -> str:
    """Write ``folder``/latest_checkpointed_iteration.txt and ``folder``/iter_XXXXXXX/mp_rank_*/; returns
    the iteration folder. ``padded_vocab``: embedding rows (default: Megatron-LM's padding for ``tp``)."""
    cfg, _ = model_config(config)
    padded_vocab = export_vocab(config, padded_vocab, tp)
    errors = legacy_layout_errors(cfg, tp, pp)
    if padded_vocab % tp:
        errors.append(f"{padded_vocab} embedding rows do not split over --tensor-model-parallel-size {tp}")
    if ep > 1 and (cfg.num_experts or 0) % ep:
        errors.append(f"--expert-model-parallel-size ({ep}) must divide the routed experts ({cfg.num_experts or 0})")
    if errors:
        raise CheckpointError("to-megatron --format torch: " + "; ".join(errors))
    top, layers = megatron_layers(config, get, padded_vocab, dtype)
    args = megatron_args(config, padded_vocab)
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.ckpt_format = tp, pp, "torch"
    if ep > 1:
        args.expert_model_parallel_size = ep
    it_dir = os.path.join(folder, iter_dirname(iteration))
    for stage, e in itertools.product(range(pp), range(ep)):
        held = stage_state(top, layers, pp, stage, cfg.tied_embeddings, ep, e)
        for rank in range(tp):  # Megatron-LM's file names: the PP rank when PP > 1, the EP rank when EP > 1
            rank_dir = f"mp_rank_{rank:02d}" + (f"_{stage:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
            model = {k: t if t is None else tp_shard(k, t, tp, rank, cfg.swiglu) for k, t in held.items()}
            os.makedirs(os.path.join(it_dir, rank_dir), exist_ok=True)
            torch.save({"model": model, "args": args, "iteration": iteration,
                        "checkpoint_version": CHECKPOINT_VERSION}, os.path.join(it_dir, rank_dir, FILE))
    with open(os.path.join(folder, TRACKER), "w") as f:
        f.write(str(iteration))
    return it_dir
