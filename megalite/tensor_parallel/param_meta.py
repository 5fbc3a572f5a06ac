"""What the model declares about each parameter, declared once and read through one function.

A layer declares, when it creates a parameter, how it shards over TP, its full (layout-free) shape and
how it is initialized; the model may amend that (a tied embedding's copies). Init, gradient
finalization, grad-norm counting and checkpoints read it back with ``param_meta(p)``.

The gradient-buffer view ``param.main_grad`` is not part of it: it is per-step state, not a
declaration, set only by ``GradBuffer`` (named as in Megatron, and used like ``param.grad``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.sharding import REPLICATED, ShardSpec

ATTRIBUTE = "megalite_meta"  # the one attribute a parameter carries its ParamMeta under


@dataclass(frozen=True)
class ParamMeta:
    full_shape: tuple[int, ...]  # the layout-free shape this rank's tensor is a shard of
    spec: ShardSpec = REPLICATED  # how the full tensor maps to this TP rank's shard
    init: str = "normal"  # 'normal' (std), 'output' (std / sqrt(2 * layers)), 'zeros' or 'ones'
    # Layout-free name of the parameter this one is a copy of (the last stage's output layer tied to the
    # first stage's embedding): it is initialized from that tensor and stored under that name.
    copy_of: str | None = None
    tied_embedding: bool = False  # one of the two copies of a word embedding tied across pipeline stages
    # The input word embedding or the output layer's weight (any copy of them): --decoupled-lr's parameters
    # (Megatron's is_embedding_or_output_parameter; the learned position embedding is not one).
    embedding_or_output: bool = False
    # A routed experts' weight: dim 0 of full_shape counts the experts, split over expert-parallel ranks in
    # contiguous blocks, and ``spec`` cuts each expert over the expert-tensor-parallel ranks (not TP).
    expert: bool = False


def declare_param(param: nn.Parameter, spec: ShardSpec, full_shape: tuple[int, ...], init: str) -> None:
    """Attach ``param``'s sharding and init description (what its layer knows when creating it)."""
    setattr(param, ATTRIBUTE, ParamMeta(tuple(full_shape), spec, init))


def amend_param(param: nn.Parameter, **changes) -> None:
    """Change some fields of ``param``'s metadata (the model knows about ties and fused layouts)."""
    setattr(param, ATTRIBUTE, dataclasses.replace(param_meta(param), **changes))


def shard_coords(meta: ParamMeta, pg: ProcessGroups) -> tuple[int, int]:
    """(rank, size) of the group ``meta.spec`` cuts over: expert-TP for expert weights, else TP."""
    return (pg.etp_rank, pg.etp_size) if meta.expert else (pg.tp_rank, pg.tp_size)


def local_shard(meta: ParamMeta, full: torch.Tensor, pg: ProcessGroups) -> torch.Tensor:
    """This rank's part of the full tensor: its experts' rows (expert weights), then its spec's shard."""
    if meta.expert:
        n = full.shape[0] // pg.ep_size
        full = full[pg.ep_rank * n:(pg.ep_rank + 1) * n]
    return meta.spec.shard(full, *shard_coords(meta, pg))


def param_meta(param: nn.Parameter) -> ParamMeta:
    """``param``'s metadata; a parameter nobody declared is whole, replicated and 'normal'-initialized."""
    meta = getattr(param, ATTRIBUTE, None)
    return meta if meta is not None else ParamMeta(tuple(param.shape))
