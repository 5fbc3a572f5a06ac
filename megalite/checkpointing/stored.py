"""Which parameters a checkpoint stores, under which layout-free keys and cut by which ShardSpec.

Taken from the model itself: a GPTModel of each pipeline stage is built on the meta device (no memory,
no init) with process groups that only carry the layout's sizes. So checkpointing knows nothing about
the model's structure and stays right when the model changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megalite.checkpointing.metadata import model_config
from megalite.model.gpt import GPTModel
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.parallel.placement import LayerSplit
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.param_meta import DENSE, ParamFamily, param_meta
from megalite.tensor_parallel.random import RNGTracker
from megalite.tensor_parallel.sharding import ShardSpec


def checkpoint_key(name: str, param: nn.Parameter) -> str:
    """The layout-free name a parameter is stored under (the last stage's tied embedding copy is the
    embedding itself, stored once by the first stage)."""
    return param_meta(param).copy_of or name


def named_params(chunks: list[nn.Module]) -> list[tuple[str, str, nn.Parameter]]:
    """(module name, checkpoint key, parameter) of every parameter of this rank's chunks; a parameter
    is stored by this rank when its name is its key."""
    return [(n, checkpoint_key(n, p), p) for c in chunks for n, p in c.named_parameters()]


@dataclass(frozen=True)
class StoredParam:
    key: str  # layout-free name, e.g. "layers.3.attention.qkv.weight"
    spec: ShardSpec  # how the full tensor is cut over its family's shard group (TP, or expert-TP for experts)
    family: ParamFamily = DENSE  # the groups it is cut and split over, and its checkpoint folders
    optimized: bool = True  # has optimizer state (not e.g. the router's expert bias, set by its own rule)


def stage_params(config: dict[str, Any], tp: int, split: LayerSplit | None = None) -> list[list[StoredParam]]:
    """For each pipeline rank of ``split`` (the layout's placement and layer counts; default one stage), the
    parameters its ``model.safetensors`` holds (all its chunks), in the order a training run stores them.
    A tied output layer on the last stage is not stored."""
    cfg, vocab = model_config(config)
    split = split or LayerSplit(cfg.num_layers, 1)
    pp, stages = split.pp, split.stages
    pg = ProcessGroups.unconnected(RankLayout(tp * pp, tp, pp), 0)
    ctx = BuildContext(pg, RNGTracker(), device=torch.device("meta"))
    out = []
    for rank in range(pp):
        chunks = []
        for c in range(split.vp):
            stage = stages.stage(rank, c)
            chunks.append(GPTModel(cfg, ctx, vocab, layer_numbers=split.stage_layers(stage),
                                   pre_process=stage == 0, post_process=stage == stages.last))
        out.append([StoredParam(k, param_meta(p).spec, param_meta(p).family, p.requires_grad)
                    for n, k, p in named_params(chunks) if n == k])
    return out


def all_specs(config: dict[str, Any], tp: int) -> dict[str, ShardSpec]:
    """Every stored parameter's ShardSpec at TP size ``tp``."""
    return {p.key: p.spec for stage in stage_params(config, tp) for p in stage}
