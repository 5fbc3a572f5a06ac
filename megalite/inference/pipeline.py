"""Forward-only passes through a model laid out over pipeline stages (and virtual chunks).

Inference needs no schedule: one batch goes through the virtual stages in order. Each rank runs its
chunks as a forward-only table (one micro-batch) on the pipeline executor, so the hidden states [s, b, h]
move in the same NCCL-safe batches as in training. Every rank knows the batch's shape (it holds the
tokens), so receive buffers need no shape exchange. Layers are held in eval mode by the caller.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.parallel.groups import Group, ProcessGroups
from megalite.pipeline.executor import PipelinePass, run_table
from megalite.pipeline.schedule_table import Action


@torch.no_grad()
def pipeline_forward(chunks: list[nn.Module], pg: ProcessGroups, tokens: torch.Tensor,
                     labels: torch.Tensor | None = None, kv_cache=None) -> torch.Tensor | None:
    """Run ``tokens`` [b, s] through every virtual stage. Returns, on the ranks of the last stage, the
    model's output (per-token loss [b, s] with ``labels``, else full logits [b, s, vocab]); None elsewhere.

    Virtual stage v = chunk * pp + pp_rank (see megalite/pipeline/partition.py): each rank visits its
    chunks in that global order."""
    b, s = tokens.shape

    def step(model: nn.Module, _: dict, hidden: torch.Tensor | None) -> torch.Tensor:
        if hidden is None:
            return model(tokens, labels=labels, kv_cache=kv_cache)
        return model(labels=labels, hidden=hidden, kv_cache=kv_cache)

    tables = [[Action("F", c, 0) for c in range(len(chunks))]] * pg.pp_size
    shape = (s, b, chunks[0].cfg.hidden_size)
    out = run_table(tables, PipelinePass(chunks, [{}], step, pg, shape, forward_only=True))
    return out[0] if out else None


def from_last_stage(tensor: torch.Tensor | None, pg: ProcessGroups, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """The last stage's ``tensor`` on every rank of this rank's pipeline group (a broadcast over PP)."""
    if pg.pp_size == 1:
        assert tensor is not None
        return tensor
    buf = tensor.contiguous() if pg.is_last_stage else torch.empty(shape, dtype=dtype, device=device)
    return pg.broadcast(buf, Group.PP, src_index=pg.pp_size - 1)
