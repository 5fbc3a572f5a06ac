"""Layout-independent initialization: every parameter's full tensor is drawn from a generator seeded
by (seed, the parameter's layout-free name), then this rank keeps its shard.

So the same --seed gives the same full model at every TP/PP/DP size: a layer's weights depend on its
global name (``layers.3.mlp.fc1.weight``), not on which rank holds it or in what order ranks build.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.param_meta import local_shard, param_meta


def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def full_init(name: str, shape: tuple[int, ...], kind: str, seed: int, std: float, num_layers: int
              ) -> torch.Tensor:
    """The full (unsharded) fp32 initial value of parameter ``name``."""
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "ones":
        return torch.ones(shape)
    if kind == "output":
        std = std / math.sqrt(2.0 * num_layers)
    elif kind != "normal":
        raise ValueError(f"unknown init kind {kind!r} for {name}")
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def initialize_parameters(model: nn.Module, pg: ProcessGroups, seed: int, std: float, num_layers: int) -> None:
    """Fill every parameter of ``model`` with its shard of the deterministic full init.

    A parameter may name the full tensor it copies with ``ParamMeta.copy_of`` (a tied output layer on
    the last pipeline stage starts as the embedding)."""
    for name, param in model.named_parameters():
        meta = param_meta(param)
        full = full_init(meta.copy_of or name, meta.full_shape, meta.init, seed, std, num_layers)
        param.copy_(local_shard(meta, full, pg))
