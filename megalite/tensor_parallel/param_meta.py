"""What the model declares about each parameter, declared once and read through one function.

A layer declares, when it creates a parameter, how it shards over TP, its full (layout-free) shape and
how it is initialized; the model may amend that (a tied embedding's copies). Init, gradient
finalization, grad-norm counting and checkpoints read it back with ``param_meta(p)``.

Each parameter belongs to a family (``ParamFamily``): the process groups it is cut, split, averaged and
counted over. Gradient buffers, the optimizer's found-inf and grad-norm partial sums, ZeRO shards and
checkpoint folders are kept apart per family and read their groups from it, so only this module and the
package that declares a family (megalite/moe for routed experts) know which families exist.

The gradient-buffer view ``param.main_grad`` is not part of it: it is per-step state, not a
declaration, set only by ``GradBuffer`` (named as in Megatron, and used like ``param.grad``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from megalite.parallel.groups import Group, ProcessGroups
from megalite.tensor_parallel.sharding import REPLICATED, ShardSpec

ATTRIBUTE = "megalite_meta"  # the one attribute a parameter carries its ParamMeta under
DP_SHARDS = "dp_shards"  # in ``ParamFamily.counted``: the family's DP group, when the optimizer shards over it


@dataclass(frozen=True)
class ParamFamily:
    """The process groups a family of parameters lives on (group names resolved against ProcessGroups)."""

    name: str  # the key buffers, partial sums and checkpoint folders are kept apart by
    shard: Group  # the group ``ParamMeta.spec`` cuts the tensor over
    split: Group | None  # dim 0 split over this group in contiguous blocks (None: not split)
    dp: Group | None  # gradients averaged and ZeRO-sharded over it; None: the run's gradient group (DP or DP x CP)
    counted: tuple[str, ...]  # found-inf / grad-norm partial sums reduced over these groups, in this order
    folder: str  # checkpoint folders: {folder}_{shard rank}[_{split rank}]_{pp rank}
    compress: bool = True  # --grad-compression applies to its DP reduction

    def dp_kind(self, pg: ProcessGroups) -> str:
        """The group its gradients are averaged and its sharded state is cut over."""
        return pg.grad_kind if self.dp is None else self.dp

    def coords(self, pg: ProcessGroups) -> tuple[int, int]:
        """(rank, size) of the group its spec cuts over."""
        return pg.index(self.shard), pg.size(self.shard)

    def split_coords(self, pg: ProcessGroups) -> tuple[int, int]:
        """(rank, size) of the group dim 0 is split over; (0, 1) when not split."""
        return (pg.index(self.split), pg.size(self.split)) if self.split is not None else (0, 1)

    def block(self, full: torch.Tensor, index: int, blocks: int) -> torch.Tensor:
        """Block ``index`` of ``blocks`` of ``full`` along the split dim (``full`` when not split)."""
        if self.split is None:
            return full
        n = full.shape[0] // blocks
        return full[index * n:(index + 1) * n]

    def reduced_over(self, pg: ProcessGroups, sharded: bool) -> list[str]:
        """The groups its partial sums are reduced over; its DP group only where its state is ``sharded``."""
        return [self.dp_kind(pg) if g == DP_SHARDS else g for g in self.counted if g != DP_SHARDS or sharded]


# Dense weights: cut over TP, averaged over DP (x CP), norms summed over TP x PP.
DENSE = ParamFamily("dense", Group.TP, None, None, (Group.MP, DP_SHARDS), "mp_rank")
# Routed experts' weights: dim 0 counts the experts, split over EP in contiguous blocks; each expert cut over
# expert-TP; averaged over expert-DP (divided by the whole gradient group: see GradBuffer); norms summed over
# expert-TP x EP, then the stages. Gradients reduced exactly (no compression).
EXPERT = ParamFamily("expert", Group.ETP, Group.EP, Group.EDP, (DP_SHARDS, Group.EMP, Group.PP), "expert_rank",
                     compress=False)
FAMILIES = {f.name: f for f in (DENSE, EXPERT)}  # in the order buffers, sums and folders are kept


def model_families(moe: bool) -> list[ParamFamily]:
    """The families a model has on some rank (the same list on every rank: their reductions are collective)."""
    return [DENSE, EXPERT] if moe else [DENSE]


@dataclass(frozen=True)
class ParamMeta:
    full_shape: tuple[int, ...]  # the layout-free shape this rank's tensor is a shard of
    spec: ShardSpec = REPLICATED  # how the full tensor maps to this rank's shard (over its family's shard group)
    init: str = "normal"  # 'normal' (std), 'output' (std / sqrt(2 * layers)), 'zeros' or 'ones'
    # Layout-free name of the parameter this one is a copy of (the last stage's output layer tied to the
    # first stage's embedding): it is initialized from that tensor and stored under that name.
    copy_of: str | None = None
    tied_embedding: bool = False  # one of the two copies of a word embedding tied across pipeline stages
    # The input word embedding or the output layer's weight (any copy of them): --decoupled-lr's parameters
    # (Megatron's is_embedding_or_output_parameter; the learned position embedding is not one).
    embedding_or_output: bool = False
    family: ParamFamily = DENSE  # the groups it is cut, split, averaged and counted over


def declare_param(param: nn.Parameter, spec: ShardSpec, full_shape: tuple[int, ...], init: str) -> None:
    """Attach ``param``'s sharding and init description (what its layer knows when creating it)."""
    setattr(param, ATTRIBUTE, ParamMeta(tuple(full_shape), spec, init))


def amend_param(param: nn.Parameter, **changes) -> None:
    """Change some fields of ``param``'s metadata (the model knows about ties and fused layouts)."""
    setattr(param, ATTRIBUTE, dataclasses.replace(param_meta(param), **changes))


def shard_coords(meta: ParamMeta, pg: ProcessGroups) -> tuple[int, int]:
    """(rank, size) of the group ``meta.spec`` cuts over (its family's: TP, or expert-TP for experts)."""
    return meta.family.coords(pg)


def local_shard(meta: ParamMeta, full: torch.Tensor, pg: ProcessGroups) -> torch.Tensor:
    """This rank's part of the full tensor: its block of the split dim (if its family splits), then its
    spec's shard."""
    return meta.spec.shard(meta.family.block(full, *meta.family.split_coords(pg)), *shard_coords(meta, pg))


def param_meta(param: nn.Parameter) -> ParamMeta:
    """``param``'s metadata; a parameter nobody declared is whole, replicated and 'normal'-initialized."""
    meta = getattr(param, ATTRIBUTE, None)
    return meta if meta is not None else ParamMeta(tuple(param.shape))
