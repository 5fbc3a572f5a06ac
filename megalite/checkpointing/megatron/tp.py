"""How megatron-core cuts a tensor over tensor parallelism, told by its name: column-parallel tensors
(word embedding and output rows, QKV, fc1 with their biases) on dim 0, row-parallel weights (proj, fc2) on
dim 1, all else replicated; SwiGLU's fc1 shard r holds [gate_r; up_r]. Both formats and both directions
use it: the legacy reader joins a rank's files (``join_tp``), the torch_dist distributed-optimizer reader
joins a bucket's TP pieces, the legacy writer cuts (``tp_shard``)."""

from __future__ import annotations

import re

import torch

from megalite.checkpointing.errors import CheckpointError

COLUMN = re.compile(r"(word_embeddings\.weight|output_layer\.weight|linear_qkv\.(weight|bias)|linear_fc1\.(weight|bias)"
                    r"|linear_fc1\.weight\d+|eh_proj\.weight"  # eh_proj: MTP's projection, column-parallel
                    r"|linear_q_proj\.weight|linear_q_up_proj\.weight|linear_kv_up_proj\.weight"  # MLA: by heads
                    r"|linear_q_down_proj\.weight|linear_kv_down_proj\.weight)$")  # the local spec's, on dim 0
ROW = re.compile(r"(linear_proj\.weight|linear_fc2\.weight|linear_fc2\.weight\d+)$")
# MLA's down-projections: the local spec's ColumnParallelLinear cuts their rows over TP, Transformer Engine's
# spec keeps them whole on every TP rank (TELinear, parallel_mode "duplicated"); a shard's rows tell which
DOWN_PROJ = re.compile(r"(linear_q_down_proj|linear_kv_down_proj)\.weight$")


def whole_rows(args: object) -> dict[str, int]:
    """The full rows of MLA's down-projections under ``args`` (Megatron-LM's saved arguments), by module name:
    a legacy TP shard holding all of them is Transformer Engine's replicated copy, not a row shard."""
    if not getattr(args, "multi_latent_attention", False):
        return {}
    rows = {"linear_kv_down_proj": (getattr(args, "kv_lora_rank", None), getattr(args, "qk_pos_emb_head_dim", None)),
            "linear_q_down_proj": (getattr(args, "q_lora_rank", None), 0)}
    return {k: int(a) + int(b) for k, (a, b) in rows.items() if isinstance(a, int) and isinstance(b, int) and a}


def tp_dim(key: str) -> int:
    """The dimension tensor parallelism cuts the megatron-core tensor ``key`` on (-1: replicated)."""
    return 1 if ROW.search(key) else 0 if COLUMN.search(key) else -1


def join_tp(key: str, parts: list[torch.Tensor], swiglu: bool, where: str,
            whole: dict[str, int] | None = None) -> torch.Tensor:
    """The full tensor from its TP shards (rank order): column-parallel ones joined on dim 0 (SwiGLU's fc1
    shards each [gate_r; up_r], joined as [gates; ups]), row-parallel ones on dim 1; a replicated tensor
    must be equal on every rank. ``whole``: MLA's down-projections' full rows (``whole_rows``), where shards
    holding them all are Transformer Engine's replicated copies."""
    if len(parts) == 1:
        return parts[0]
    dim = tp_dim(key)
    down = DOWN_PROJ.search(key)
    if down and whole and all(p.dim() == 2 and p.shape[0] == whole.get(down[1]) for p in parts):
        dim = -1
    if dim == 0 and swiglu and "linear_fc1" in key:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([_cat(key, [h[0] for h in halves], 0, where), _cat(key, [h[1] for h in halves], 0, where)])
    if dim >= 0:
        return _cat(key, parts, dim, where)
    for t, p in enumerate(parts[1:], 1):
        if p.shape != parts[0].shape or not torch.equal(p, parts[0]):
            raise CheckpointError(f"{where}: {key} is replicated over TP but TP rank {t} holds other values")
    return parts[0]


def _cat(key: str, parts: list[torch.Tensor], dim: int, where: str) -> torch.Tensor:
    if len({p.dim() for p in parts}) != 1 or parts[0].dim() <= dim:
        raise CheckpointError(f"{where}: {key}: its TP shards cannot be joined on dim {dim} "
                              f"(shapes {[tuple(p.shape) for p in parts]})")
    other = {tuple(s for i, s in enumerate(p.shape) if i != dim) for p in parts}
    if len(other) != 1:
        raise CheckpointError(f"{where}: {key}: its TP shards' shapes {[tuple(p.shape) for p in parts]} "
                              f"differ off dim {dim}")
    return torch.cat(parts, dim=dim)


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
