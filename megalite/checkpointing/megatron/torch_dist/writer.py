"""A megalite checkpoint written as Megatron-LM's ``torch_dist`` checkpoint, loadable at any TP by
megatron-core's ``dist_checkpointing.load``.

megatron-core's sharded state dict names each tensor by a layout-free key, and its torch_dist loader
reshards on read: a folder holding every tensor whole (one chunk each) under those keys is a valid
checkpoint for every TP/PP layout. So the export writes full tensors, no cutting, under the names
megatron/export.py gives them (the rules both formats' writers share), and:

- layers stacked on a leading layer axis: ``decoder.layers.<suffix>`` of shape [L, ...]; a model mixing
  dense and MoE layers (--moe-layer-freq) keyed per layer, ``decoder.layers.<i>.<suffix>`` (global layer
  numbers), as megatron-core keys non-homogeneous layers;
- every linear's ``_extra_state`` a sharded object per layer (``<key>/shard_<i>_<L>``, or
  ``shard_0_1`` under a per-layer key, holding the list ``[None]``), since the loader asks for it and fails
  on a missing key.

Next to the tensors: ``metadata.json`` (the backend megatron-core's loader dispatches on) and
``common.pt`` (``args`` as Megatron-LM's training loop saves them, iteration, checkpoint version), so
Megatron-LM's ``--load`` and this project's ``from-megatron`` both read the folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch

from megalite import compat
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
from megalite.checkpointing.paths import TRACKER, iter_dirname

BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}


def _alike(layers: list[dict[str, torch.Tensor]]) -> bool:
    """Whether every layer holds the same keys (else --moe-layer-freq mixes dense and MoE layers)."""
    return all(set(layer) == set(layers[0]) for layer in layers)


def megatron_tensors(top: dict[str, torch.Tensor], layers: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """megatron-core's sharded keys -> full tensors (megatron_layers' output): the layers stacked on a leading
    axis, or, for a model whose layers differ (dense and MoE layers), one key per layer under its global
    number (``decoder.layers.<i>.<suffix>``), as megatron-core's TransformerBlock keys non-homogeneous layers."""
    if not _alike(layers):
        return {**top, **{f"decoder.layers.{i}.{suffix}": t for i, layer in enumerate(layers)
                          for suffix, t in layer.items()}}
    stacked = {f"decoder.layers.{suffix}": torch.stack([layer[suffix] for layer in layers]).contiguous()
               for suffix in layers[0]}
    return {**top, **stacked}


def _shard(axes: list[tuple[int, int]]) -> str:
    """A sharded object's unique-key suffix from its (offset, size) per axis (one axis (0, 1) if none)."""
    axes = axes or [(0, 1)]
    return f"shard_{'.'.join(str(o) for o, _ in axes)}_{'.'.join(str(n) for _, n in axes)}"


def _extra_states(layers: list[dict[str, torch.Tensor]]) -> dict[str, list[None]]:
    """One empty ``_extra_state`` object per linear and layer (per layer and expert for routed experts)
    under megatron-core's unique keys, ``<key>/shard_<offset>_<shape>``: on the layer axis of stacked keys
    (``decoder.layers.<module>._extra_state/shard_<i>_<L>``), or under each layer's own key when the layers
    differ (``decoder.layers.<i>.<module>._extra_state/shard_0_1``), an expert's on the expert axis too.
    The value is the list megatron-core's loader unpickles (torch's planner pickles a non-tensor value
    itself; a BytesIO would be pickled as a BytesIO)."""
    stacked = _alike(layers)
    out: dict[str, list[None]] = {}
    for i, layer in enumerate(layers):
        prefix, axes = ("decoder.layers.", [(i, len(layers))]) if stacked else (f"decoder.layers.{i}.", [])
        out.update({f"{prefix}{module}._extra_state/{_shard(axes)}": [None] for module in layer_linears(layer)})
        fc1 = layer.get(EXPERTS["mlp.experts.fc1_weight"])
        experts = 0 if fc1 is None else fc1.shape[0]
        out.update({f"{prefix}mlp.experts.experts.{fc}._extra_state/{_shard([*axes, (j, experts)])}": [None]
                    for fc in ("linear_fc1", "linear_fc2") for j in range(experts)})
    return out


def save_torch_dist(folder: str, config: dict[str, Any], get: Callable[[str], torch.Tensor], iteration: int,
                    *, tp_hint: int = 1, padded_vocab: int | None = None, dtype: torch.dtype | None = None,
                    extra_common: dict[str, Any] | None = None) -> str:
    """Write ``folder``/latest_checkpointed_iteration.txt and ``folder``/iter_XXXXXXX/ in torch_dist format;
    returns the iteration folder. ``tp_hint``: the TP Megatron-LM will load at, for its vocabulary padding
    (``padded_vocab`` overrides it; it must equal what the loading run computes)."""
    padded = export_vocab(config, padded_vocab, tp_hint)
    top, layers = megatron_layers(config, get, padded, dtype)
    state: dict[str, Any] = {**megatron_tensors(top, layers), **_extra_states(layers),
                             **{f"{m}._extra_state/shard_0_1": [None] for m in mtp_linears(top)},
                             **{f"{prefix}.mlp.experts.experts.{fc}._extra_state/{_shard([(j, experts)])}": [None]
                                for prefix, experts in mtp_experts(top).items()
                                for fc in ("linear_fc1", "linear_fc2") for j in range(experts)}}
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
