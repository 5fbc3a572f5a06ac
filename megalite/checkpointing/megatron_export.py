"""A megalite checkpoint written as Megatron-LM's ``torch_dist`` checkpoint, loadable at any TP by
megatron-core's ``dist_checkpointing.load``.

megatron-core's sharded state dict names each tensor by a layout-free key, and its torch_dist loader
reshards on read: a folder holding every tensor whole (one chunk each) under those keys is a valid
checkpoint for every TP/PP layout. So the export writes full tensors, no cutting. The keys are the ones
megatron-core 0.16's ``GPTModel.sharded_state_dict()`` gives the local layer spec (checked by
tests/test_megatron_export.py against that call):

- layers stacked on a leading layer axis: ``decoder.layers.<suffix>`` of shape [L, ...];
- the norms under Transformer Engine's fused names (``self_attention.linear_qkv.layer_norm_weight``,
  ``mlp.linear_fc1.layer_norm_weight``), which the local spec saves its norms under too;
- SwiGLU's fc1 whole as [gate; up] (megatron-core's factory reads its TP pieces out of that order);
- a tied model has no ``output_layer.weight`` key; the vocabulary padded to Megatron's padded size;
- every linear's ``_extra_state`` a sharded object per layer (``<key>/shard_<i>_<L>`` holding
  the list ``[None]``), since the loader asks for it and fails on a missing key.

Next to the tensors: ``metadata.json`` (the backend megatron-core's loader dispatches on) and
``common.pt`` (``args`` as Megatron-LM's training loop saves them, iteration, checkpoint version), so
Megatron-LM's ``--load`` and this project's ``from-megatron`` both read the folder. Routed experts are not
exported (their per-expert keys depend on the expert layer spec).
"""

from __future__ import annotations

import json
import os
from argparse import Namespace
from collections.abc import Callable
from typing import Any

import torch

from megalite import compat
from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.megatron_names import LAYER, TOP
from megalite.checkpointing.metadata import model_config
from megalite.checkpointing.paths import TRACKER, iter_dirname
from megalite.checkpointing.stored import all_specs
from megalite.tensor_parallel.layers import padded_vocab_size

# megalite layer suffix -> megatron-core's sharded key suffix (local spec; norms under the fused names)
FUSED_NORMS = {"input_norm.weight": "self_attention.linear_qkv.layer_norm_weight",
               "input_norm.bias": "self_attention.linear_qkv.layer_norm_bias",
               "pre_mlp_norm.weight": "mlp.linear_fc1.layer_norm_weight",
               "pre_mlp_norm.bias": "mlp.linear_fc1.layer_norm_bias"}
EXPORT_LAYER = {**{v: k for k, v in LAYER.items() if v not in FUSED_NORMS}, **FUSED_NORMS}
EXPORT_TOP = {"embedding.word.weight": "embedding.word_embeddings.weight",
              "embedding.position.weight": "embedding.position_embeddings.weight",
              "final_norm.weight": "decoder.final_layernorm.weight",
              "final_norm.bias": "decoder.final_layernorm.bias",
              "output_layer.weight": "output_layer.weight"}
assert all(TOP[v] == k for k, v in EXPORT_TOP.items())
EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
CHECKPOINT_VERSION = 3.0
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}

# Megatron-LM argument names copied from megalite's config unchanged
ARG_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels", "seq_length",
              "max_position_embeddings", "position_embedding_type", "rotary_base", "rotary_percent",
              "normalization", "norm_epsilon", "apply_layernorm_1p", "swiglu", "untie_embeddings_and_output_weights",
              "add_qkv_bias", "hidden_dropout", "attention_dropout", "init_method_std",
              "make_vocab_size_divisible_by")


def megatron_args(config: dict[str, Any], padded_vocab: int) -> Namespace:
    """The ``args`` Namespace Megatron-LM would have saved for this model (its own argument names; the
    inverse of megatron_args.config_from_args), so the folder describes its model without megalite."""
    fields = {k: config[k] for k in ARG_FIELDS if config.get(k) is not None}
    heads = int(config["num_attention_heads"])
    groups = config.get("num_query_groups") if config.get("group_query_attention") else None
    fields.update(group_query_attention=bool(groups), num_query_groups=groups or heads,
                  add_bias_linear=not config.get("disable_bias_linear", False),
                  vocab_size=int(config["vocab_size"]), padded_vocab_size=padded_vocab,
                  tensor_model_parallel_size=1, pipeline_model_parallel_size=1, ckpt_format="torch_dist")
    return Namespace(**fields)


def megatron_tensors(config: dict[str, Any], get: Callable[[str], torch.Tensor], padded_vocab: int,
                     dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """megatron-core's sharded keys -> full tensors, the layers stacked on a leading axis; ``get(key)`` the
    full tensor of a megalite key."""
    cfg, _ = model_config(config)
    if cfg.num_experts:
        raise CheckpointError("to-megatron: MoE models are not exported (only dense GPT/Llama-style ones)")
    keys = list(all_specs(config, 1))
    out: dict[str, torch.Tensor] = {}
    per_layer: dict[str, list[torch.Tensor | None]] = {}
    for key in keys:
        t = get(key)
        t = t.to(dtype) if dtype is not None else t
        if key in EXPORT_TOP:
            if key in ("embedding.word.weight", "output_layer.weight") and t.shape[0] < padded_vocab:
                t = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])
            out[EXPORT_TOP[key]] = t.contiguous()
            continue
        _, i, suffix = key.split(".", 2)
        if suffix not in EXPORT_LAYER:
            raise CheckpointError(f"to-megatron: {key} has no megatron-core counterpart")
        per_layer.setdefault(EXPORT_LAYER[suffix], [None] * cfg.num_layers)[int(i)] = t
    for suffix, ts in per_layer.items():
        if any(t is None for t in ts):
            raise CheckpointError(f"to-megatron: {suffix} is missing in some layers")
        out[f"decoder.layers.{suffix}"] = torch.stack(ts).contiguous()  # type: ignore[arg-type]
    return out


def export_vocab(config: dict[str, Any], padded_vocab: int | None, tp: int) -> int:
    """The embedding rows an export writes: ``padded_vocab`` if given (never below the vocabulary), else
    Megatron-LM's padding of the vocabulary for ``tp``."""
    cfg, vocab = model_config(config)
    padded = padded_vocab or padded_vocab_size(vocab, cfg.make_vocab_size_divisible_by, tp)
    if padded < vocab:
        raise CheckpointError(f"to-megatron: --padded-vocab-size {padded} is below the vocabulary ({vocab})")
    return padded


def _extra_states(num_layers: int) -> dict[str, list[None]]:
    """One empty ``_extra_state`` object per linear and layer, under megatron-core's unique keys. The
    value is the list megatron-core's loader unpickles (torch's planner pickles a non-tensor value itself;
    a BytesIO would be pickled as a BytesIO)."""
    return {f"decoder.layers.{module}._extra_state/shard_{i}_{num_layers}": [None]
            for module in EXTRA_STATE for i in range(num_layers)}


def save_torch_dist(folder: str, config: dict[str, Any], get: Callable[[str], torch.Tensor], iteration: int,
                    *, tp_hint: int = 1, padded_vocab: int | None = None, dtype: torch.dtype | None = None,
                    extra_common: dict[str, Any] | None = None) -> str:
    """Write ``folder``/latest_checkpointed_iteration.txt and ``folder``/iter_XXXXXXX/ in torch_dist format;
    returns the iteration folder. ``tp_hint``: the TP Megatron-LM will load at, for its vocabulary padding
    (``padded_vocab`` overrides it; it must equal what the loading run computes)."""
    cfg, _ = model_config(config)
    padded = export_vocab(config, padded_vocab, tp_hint)
    state: dict[str, Any] = {**megatron_tensors(config, get, padded, dtype), **_extra_states(cfg.num_layers)}
    it_dir = os.path.join(folder, iter_dirname(iteration))
    os.makedirs(it_dir, exist_ok=True)
    compat.save_distributed_checkpoint(state, it_dir)
    common = {"args": megatron_args(config, padded), "iteration": iteration,
              "checkpoint_version": CHECKPOINT_VERSION, **(extra_common or {})}
    torch.save(common, os.path.join(it_dir, "common.pt"))
    with open(os.path.join(it_dir, "metadata.json"), "w") as f:
        json.dump(BACKEND, f)
    with open(os.path.join(folder, TRACKER), "w") as f:
        f.write(str(iteration))
    return it_dir
