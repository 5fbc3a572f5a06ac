"""forward_backward(): pick this rank's schedule table for the step and run it.

p = 1 is plain gradient accumulation (F0 B0 F1 B1 ...); p > 1 is 1F1B (or GPipe), interleaved when
each rank holds several model chunks. The same executor runs all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from megalite.model.gpt import GPTModel
from megalite.parallel.groups import ProcessGroups
from megalite.pipeline.executor import PipelineRecord, run_table
from megalite.pipeline.schedule_table import ScheduleSpec, forward_only_table, rank_table


def lm_forward_step(chunk: nn.Module, mb: dict[str, torch.Tensor], hidden: torch.Tensor | None) -> torch.Tensor:
    """One micro-batch through one chunk: hidden states out, or the mean token loss on the last stage."""
    assert isinstance(chunk, GPTModel)
    if not chunk.post_process:
        return chunk(mb["tokens"] if chunk.pre_process else None, hidden=hidden)
    per_token = chunk(mb["tokens"] if chunk.pre_process else None, labels=mb["labels"], hidden=hidden)
    mask = mb["loss_mask"]
    return (per_token.float() * mask).sum() / mask.sum()


def forward_backward(chunks: Sequence[GPTModel], microbatches: Sequence[dict], pg: ProcessGroups,
                     schedule: str = "1f1b", forward_only: bool = False, record: PipelineRecord | None = None,
                     loss_scale: float = 1.0, last_backward: Callable[[int], None] | None = None
                     ) -> list[torch.Tensor]:
    """Run all micro-batches of a step; gradients accumulate in the chunks' parameters (each loss
    scaled by loss_scale/m). ``last_backward(chunk)`` is called before a chunk's last backward, so its
    gradient buckets can start reducing while that backward runs. Returns the last stage's unscaled
    per-micro-batch losses (empty on other stages)."""
    spec = ScheduleSpec(pg.pp_size, len(chunks), len(microbatches), schedule)
    table = forward_only_table(spec) if forward_only else rank_table(spec, pg.pp_rank)
    first = chunks[0]
    mb = microbatches[0]["tokens"]
    seq = mb.shape[1] // (pg.tp_size if first.sequence_parallel else 1)
    recv_shape = (seq, mb.shape[0], first.cfg.hidden_size)
    dtype = next(first.parameters()).dtype
    return run_table(table, chunks, microbatches, lm_forward_step, pg, recv_shape, dtype, forward_only, record,
                     loss_scale, last_backward)
