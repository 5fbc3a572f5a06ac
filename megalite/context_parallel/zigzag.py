"""The load-balanced (zigzag) split of a sequence over c context-parallel ranks.

The sequence is cut into 2c equal chunks and rank r keeps chunk r followed by chunk 2c-1-r. Under a
causal mask, chunk i attends to i+1 chunks, so every rank's two chunks attend to (r+1) + (2c-r) = 2c+1
chunks in all: the attention work is the same on every rank, unlike a plain split into c pieces.
"""

from __future__ import annotations

import torch

from megalite.attention import Chunk, Documents, chunk_pieces


def check_divisible(seq_len: int, cp: int) -> None:
    """The zigzag split needs 2c equal chunks."""
    if cp < 1 or seq_len % (2 * cp):
        raise ValueError(f"--seq-length {seq_len} must be divisible by 2 x --context-parallel-size "
                         f"(= {2 * cp}): each sequence is cut into 2c equal chunks")


def zigzag_index(seq_len: int, cp: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions (int64) rank ``cp_rank`` keeps, in its local order: chunk r, then chunk 2c-1-r."""
    check_divisible(seq_len, cp)
    if not 0 <= cp_rank < cp:
        raise ValueError(f"context-parallel rank {cp_rank} is outside 0..{cp - 1}")
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk, device=device)
    return torch.cat([first, second])


def zigzag_split(t: torch.Tensor, dim: int, cp: int, cp_rank: int) -> torch.Tensor:
    """This rank's part of ``t`` along ``dim`` (the full sequence there): chunks r and 2c-1-r, concatenated.
    Differentiable (the gradient lands in the two chunks' places)."""
    seq_len = t.shape[dim]
    check_divisible(seq_len, cp)
    chunk = seq_len // (2 * cp)
    return torch.cat([t.narrow(dim, cp_rank * chunk, chunk), t.narrow(dim, (2 * cp - 1 - cp_rank) * chunk, chunk)],
                     dim=dim)


def zigzag_positions(s_local: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """[c, s_local]: the global positions every CP rank holds, row j for rank j (sequence c x s_local)."""
    return torch.stack([zigzag_index(s_local * cp, cp, j, device) for j in range(cp)])


def natural_order(s_local: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """The permutation that puts the ranks' local chunks, concatenated in rank order, back in sequence
    order: ``gathered.index_select(dim, natural_order(...))`` is the natural sequence."""
    return zigzag_positions(s_local, cp, device).flatten().argsort()


def zigzag_chunks(cp_rank: int, cp: int, s_local: int, local: int = 0) -> list[Chunk]:
    """The two chunks of global positions rank ``cp_rank`` holds, at local offsets ``local`` and
    ``local + s_local / 2`` (the blockwise attention's view of ``zigzag_index``)."""
    half = s_local // 2
    return [Chunk(cp_rank * half, half, local), Chunk((2 * cp - 1 - cp_rank) * half, half, local + half)]


def zigzag_work(documents: Documents, cp: int) -> list[int]:
    """Query-key pairs each CP rank's attention computes for ``documents`` under the zigzag split: equal on
    every rank for one document per sample; with packed documents the split balances only on average (the
    figures in bench/README.md, "Packed documents")."""
    s_local = documents.seq_length // cp
    work = []
    for r in range(cp):
        mine = zigzag_chunks(r, cp, s_local)
        pieces = [p for j in range(cp) for p in chunk_pieces(documents, mine, zigzag_chunks(j, cp, s_local))]
        work.append(sum(p.pairs * len(range(documents.batch)[p.batch]) for p in pieces))
    return work
