"""forward_backward(): pick this rank's schedule table for the step and run it.

p = 1 is plain gradient accumulation (F0 B0 F1 B1 ...); p > 1 is 1F1B (or GPipe), interleaved when
each rank holds several model chunks. The same executor runs all of them. The pipeline knows no model:
the caller gives the step function and the shape of the hidden states passed between stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from megalite.parallel.groups import ProcessGroups
from megalite.pipeline.executor import ForwardStep, PipelineRecord, run_table
from megalite.pipeline.schedule_table import ScheduleSpec, build_tables, forward_only_table


def forward_backward(chunks: Sequence[nn.Module], microbatches: Sequence[dict], pg: ProcessGroups,
                     forward_step: ForwardStep, recv_shape: tuple[int, ...], schedule: str = "1f1b",
                     forward_only: bool = False, record: PipelineRecord | None = None, loss_scale: float = 1.0,
                     last_backward: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """Run all micro-batches of a step; gradients accumulate in the chunks' parameters (each loss
    scaled by loss_scale/m). ``last_backward(chunk)`` is called before a chunk's last backward, so its
    gradient buckets can start reducing while that backward runs. Returns the last stage's unscaled
    per-micro-batch losses (empty on other stages)."""
    spec = ScheduleSpec(pg.pp_size, len(chunks), len(microbatches), schedule)
    tables = [forward_only_table(spec)] * spec.pp if forward_only else build_tables(spec)
    dtype = next(chunks[0].parameters()).dtype
    return run_table(tables, chunks, microbatches, forward_step, pg, recv_shape, dtype, forward_only, record,
                     loss_scale, last_backward)
