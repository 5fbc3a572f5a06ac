"""How a full (layout-free) parameter maps to one tensor-parallel rank's shard, and back.

Every parameter carries a ShardSpec (in its ParamMeta, see param_meta.py). It is the single source
of truth used by deterministic init (build the full tensor, keep this rank's slice), gradient tests
(gather the full gradient), grad-norm counting (a replicated gradient counts once), checkpoint
resharding and Hugging Face conversion.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.parallel.groups import Group, ProcessGroups


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class ShardSpec:
    """Split along ``dim`` into ``size`` contiguous parts, or replicate when ``dim`` is None.

    ``chunks`` > 1 means the full tensor is ``chunks`` blocks stacked along ``dim`` (e.g. SwiGLU's
    [gate; up]) and each rank takes its part of every block, so each shard keeps the same structure.
    ``partial_grad`` marks a replicated parameter whose per-rank gradients are partial sums (sequence
    parallel norms): they are summed over TP before the step.
    """

    dim: int | None = None
    chunks: int = 1
    partial_grad: bool = False

    @property
    def replicated(self) -> bool:
        return self.dim is None

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        if self.dim is None or size == 1:
            return full
        blocks = full.chunk(self.chunks, dim=self.dim)
        return torch.cat([b.chunk(size, dim=self.dim)[rank] for b in blocks], dim=self.dim)

    def unshard(self, parts: list[torch.Tensor]) -> torch.Tensor:
        if self.dim is None or len(parts) == 1:
            return parts[0]
        per_rank = [p.chunk(self.chunks, dim=self.dim) for p in parts]
        return torch.cat([torch.cat([pr[c] for pr in per_rank], dim=self.dim) for c in range(self.chunks)],
                         dim=self.dim)

    def counted_ranges(self, shape: tuple[int, ...], rank: int, size: int) -> list[tuple[int, int]]:
        """Flat element ranges of this rank's shard that count in the global grad norm: a replicated
        gradient is the same on every TP rank and counts on rank 0 only."""
        if self.dim is None and rank != 0:
            return []
        return [(0, _numel(shape))]

    def finalize_grad(self, grad: torch.Tensor, pg: ProcessGroups) -> None:
        if self.partial_grad:
            pg.all_reduce(grad, Group.TP)


@dataclass(frozen=True)
class VocabShardSpec(ShardSpec):
    """Rows of a (vocab, hidden) table: the full tensor has the true vocab; shards are padded to
    ``padded_vocab`` rows with zeros so that the full model is the same at every TP size."""

    vocab_size: int = 0
    padded_vocab: int = 0

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        pad = self.padded_vocab - full.shape[0]
        padded = torch.cat([full, full.new_zeros((pad, *full.shape[1:]))]) if pad else full
        return padded.chunk(size, dim=0)[rank].clone()

    def unshard(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts, dim=0)[: self.vocab_size]


@dataclass(frozen=True)
class QKVShardSpec(ShardSpec):
    """Rows of the fused QKV projection, Megatron's layout: for each of ``groups`` KV groups, its
    ``heads / groups`` query heads, then its key head, then its value head (``head_dim`` rows each).

    With groups >= TP, each rank holds whole groups (a contiguous split). With groups < TP, the
    ``TP / groups`` ranks of a group each hold a slice of its query heads and a copy of its K and V;
    those copies get partial gradients that ``finalize_grad`` sums, and they count once in the norm.
    """

    heads: int = 0
    groups: int = 0
    head_dim: int = 0

    def _replicas(self, size: int) -> int:
        return size // self.groups if size > self.groups else 1

    def _group_blocks(self, full: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(query rows, kv rows) of each group."""
        q_rows = self.heads // self.groups * self.head_dim
        blocks = full.chunk(self.groups, dim=0)
        return [(b[:q_rows], b[q_rows:]) for b in blocks]

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        if size <= self.groups:
            return full.chunk(size, dim=0)[rank].clone()
        rep = self._replicas(size)
        q, kv = self._group_blocks(full)[rank // rep]
        return torch.cat([q.chunk(rep, dim=0)[rank % rep], kv]).clone()

    def unshard(self, parts: list[torch.Tensor]) -> torch.Tensor:
        size = len(parts)
        if size <= self.groups:
            return torch.cat(parts, dim=0)
        rep = self._replicas(size)
        q_local = self.heads // size * self.head_dim
        out = []
        for g in range(self.groups):
            mine = parts[g * rep:(g + 1) * rep]
            out += [p[:q_local] for p in mine] + [mine[0][q_local:]]
        return torch.cat(out, dim=0)

    def counted_ranges(self, shape: tuple[int, ...], rank: int, size: int) -> list[tuple[int, int]]:
        """The query rows always count; a shared group's K/V copy counts on its first rank only."""
        rep = self._replicas(size)
        if rep == 1 or rank % rep == 0:
            return [(0, _numel(shape))]
        q_local = self.heads // size * self.head_dim
        return [(0, q_local * (_numel(shape) // shape[0]))]

    def finalize_grad(self, grad: torch.Tensor, pg: ProcessGroups) -> None:
        """Sum the K/V gradient copies of ranks that share a group: each rank writes its copy into its
        group's slot of a buffer, one TP all-reduce sums the slots, each rank reads its slot back."""
        size = pg.tp_size
        rep = self._replicas(size)
        if rep == 1:
            return
        q_local = self.heads // size * self.head_dim
        kv = grad[q_local:]
        slots = kv.new_zeros((self.groups, *kv.shape))
        group = pg.tp_rank // rep
        slots[group] = kv
        pg.all_reduce(slots, Group.TP)
        kv.copy_(slots[group])


REPLICATED = ShardSpec()

