"""The distributed optimizer's ``dp_reshardable`` torch_dist state (Megatron-LM's default) per parameter.

That sharding saves each gradient bucket's state flat, as megatron-core's buffer lays it out, under
``optimizer.distributed.dp_group_idx_G.gbuf_idx_B.dtype_(..).bucket_idx_K.{param,exp_avg,exp_avg_sq}``:
one tensor per bucket of its unpadded size, in bucket coordinates (each DP rank's contiguous slice is a
chunk of it, so the DP split needs no undoing). ``G`` is the rank in the tensor x pipeline group, one
set of buffers per model-parallel rank. The layout is rebuilt from the checkpoint alone (megatron_buffer.py,
shared with the legacy ``distrib_optim.pt``): the rank's parameters (the model keys, the TP cut of each)
walked in reverse of megatron-core's parameter order, each start rounded up to 64 elements, a bucket
ending exactly where its saved size ends. Every bucket must be filled exactly and agree with the saved
``per_bucket_numel_unpadded``, and a replicated parameter's state must be the same on every TP rank; a
state that does not fit (the Transformer Engine spec, pipeline stages: a group per stage, experts, more
buffers) is not read, and why is returned.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.megatron_buffer import group_steps, place_buffer
from megalite.checkpointing.megatron_legacy import join_tp, tp_dim
from megalite.checkpointing.megatron_names import SKIPPED

BUCKET = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)"
                    r"\.(param|exp_avg|exp_avg_sq)$")
FIELDS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "param": "main"}
# megatron-core's parameter registration order (GPTModel, local spec): the buffer holds it reversed. The
# local spec saves its norms under the fused names as well, so both names share a slot.
FIRST = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
LAYER = (("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
         ("input_layernorm.bias", "self_attention.linear_qkv.layer_norm_bias"),
         ("self_attention.linear_proj.weight",), ("self_attention.linear_proj.bias",),
         ("self_attention.linear_qkv.weight",), ("self_attention.linear_qkv.bias",),
         ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
         ("pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias"),
         ("mlp.linear_fc1.weight",), ("mlp.linear_fc1.bias",), ("mlp.linear_fc2.weight",), ("mlp.linear_fc2.bias",))
LAST = (("decoder.final_layernorm.weight", "decoder.final_norm.weight"),
        ("decoder.final_layernorm.bias", "decoder.final_norm.bias"), ("output_layer.weight",))

Param = tuple[str, tuple[int, ...], int]  # per-layer name, full shape, cut dim (-1: replicated)


def _ordered(src: Any, model_keys: Iterable[str]) -> list[Param] | str:
    """The model's parameters in megatron-core's order, each per layer, with its full shape and cut."""
    slots: dict[str, tuple[int, int]] = {k: (0, i) for i, k in enumerate(FIRST)}
    slots.update({k: (1, i) for i, names in enumerate(LAYER) for k in names})
    slots.update({k: (2, i) for i, names in enumerate(LAST) for k in names})
    found: list[tuple[tuple[int, int, int], Param]] = []
    for key in model_keys:
        if SKIPPED.search(key):
            continue
        shape = src.shape(key)
        stacked = key.startswith("decoder.layers.") and not key.split(".")[2].isdigit()
        suffix = key[len("decoder.layers."):] if stacked else key
        if suffix not in slots:
            return f"{key} has no known place in megatron-core's parameter order"
        dim = tp_dim(key)
        part, slot = slots[suffix]
        if not stacked:
            found.append(((part, 0, slot), (key, shape, dim)))
            continue
        found += [((1, i, slot), (f"decoder.layers.{i}.{suffix}", shape[1:], dim)) for i in range(shape[0])]
    found.sort(key=lambda item: item[0])
    if len({order for order, _ in found}) != len(found):
        return "two keys name the same parameter (a norm under both its names)"
    return [p for _, p in found]


def _place(params: list[Param], tp: int, sizes: list[int]) -> dict[str, tuple[int, int, tuple[int, ...]]] | str:
    """Per parameter (bucket, start in it, this rank's shape): each full shape cut over TP, the buffer walked
    in reverse order."""
    shapes = []
    for name, shape, dim in reversed(params):
        local = list(shape)
        if dim >= 0:
            if shape[dim] % tp:
                return f"{name}'s {shape} does not split over TP {tp}"
            local[dim] //= tp
        shapes.append((name, tuple(local)))
    return place_buffer(shapes, sizes)


def _buckets(keys: Iterable[str]) -> dict[int, dict[str, dict[int, str]]] | str:
    """dp_group_idx -> field -> bucket index -> key."""
    out: dict[int, dict[str, dict[int, str]]] = {}
    for key in keys:
        m = BUCKET.match(key)
        if m is None:
            continue
        if m[2] != "0":
            return f"{key}: more than one gradient buffer (mixed dtypes) is not read"
        out.setdefault(int(m[1]), {}).setdefault(FIELDS[m[5]], {})[int(m[4])] = key
    return out or "no bucket tensors"


def _unwrap(obj: Any) -> Any:
    while isinstance(obj, list) and len(obj) == 1:
        obj = obj[0]
    return obj


def _rank_sizes(src: Any, group: int, fields: dict[str, dict[int, str]]) -> list[int] | str:
    """The saved bucket sizes of one model-parallel rank, checked against its per_bucket_numel_unpadded."""
    keys = fields.get("exp_avg", {})
    if sorted(keys) != list(range(len(keys))) or any(sorted(f) != sorted(keys) for f in fields.values()):
        return f"dp_group_idx_{group}'s buckets are not numbered 0..n for every field"
    sizes = [src.shape(keys[b])[0] for b in range(len(keys))]
    saved = _unwrap(src.object(f"optimizer.distributed.dp_group_idx_{group}.per_bucket_numel_unpadded"))
    if not isinstance(saved, dict) or len(saved) != 1 or list(next(iter(saved.values()))) != sizes:
        return f"dp_group_idx_{group}'s per_bucket_numel_unpadded {saved!r:.80} is not its buckets' sizes {sizes}"
    return sizes


def dp_reshardable_state(src: Any, model_keys: list[str], args: Any
                         ) -> tuple[dict[str, dict[str, torch.Tensor]], float] | str:
    """field (exp_avg, exp_avg_sq, main) -> megatron-core per-layer name -> full tensor, and Adam's step;
    or why the state is not read."""
    impl, tp = getattr(args, "transformer_impl", None), int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    if impl not in (None, "local") or getattr(args, "num_experts", None):
        return (f"its layout is read for the local spec without experts only (transformer_impl {impl}, experts "
                f"{getattr(args, 'num_experts', None)})")
    params, groups = _ordered(src, model_keys), _buckets(src.keys())
    if isinstance(params, str) or isinstance(groups, str):
        return params if isinstance(params, str) else str(groups)
    if sorted(groups) != list(range(tp)):  # one group per TP rank: each must then hold every layer (no PP)
        return f"it holds dp groups {sorted(groups)}, one per TP rank of {tp} without pipeline stages is read"
    shards: dict[str, dict[str, list[torch.Tensor]]] = {}
    steps = set()
    for g in range(tp):
        sizes = _rank_sizes(src, g, groups[g])
        placed = sizes if isinstance(sizes, str) else _place(params, tp, sizes)
        if isinstance(placed, str):
            return placed
        for field, keys in groups[g].items():
            flat = [src.tensor(keys[b]) for b in range(len(keys))]
            for name, (b, start, shape) in placed.items():
                n = int(torch.Size(shape).numel())
                shards.setdefault(field, {}).setdefault(name, []).append(flat[b][start:start + n].view(shape).float())
        steps |= group_steps(_unwrap(src.object(f"optimizer.distributed.dp_group_idx_{g}.optimizer")))
    if len(steps) != 1 or min(steps) < 0:
        return f"its optimizer objects hold no single step count ({sorted(steps)[:4]})"
    swiglu = bool(getattr(args, "swiglu", False))
    try:  # a replicated parameter whose state differs between TP ranks: the layout is not megatron-core's
        out = {f: {n: join_tp(n, ts, swiglu, f"optimizer {f}") for n, ts in per.items()} for f, per in shards.items()}
    except CheckpointError as e:
        return str(e)
    return out, steps.pop()
