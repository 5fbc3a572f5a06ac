"""forward_backward(): pick this rank's schedule table for the step and run it.

p = 1 is plain gradient accumulation (F0 B0 F1 B1 ...); p > 1 is 1F1B (or GPipe), interleaved when
each rank holds several model chunks, or a zero-bubble schedule (ZB-H1, ZB-V: zero_bubble.py). The same
executor runs all of them. The pipeline knows no model: the caller gives the step function and the shape
of the hidden states passed between stages.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megalite.pipeline.executor import PipelinePass, run_table
from megalite.pipeline.schedule_table import ZERO_BUBBLE, ScheduleSpec, build_tables, forward_only_table
from megalite.tensor_parallel.weight_grad import WeightGradStore


def forward_backward(job: PipelinePass, schedule: str = "1f1b") -> list[torch.Tensor]:
    """Run all micro-batches of a step on ``schedule``'s tables; gradients accumulate in the chunks'
    parameters (each micro-batch's backward seeded as ``job.scaling`` says). Returns the last stage's
    per-micro-batch losses, before the backward factor S / m (empty on other stages). A zero-bubble schedule
    splits each backward through a fresh weight-gradient store (tensor_parallel/weight_grad.py)."""
    spec = ScheduleSpec(job.pg.pp_size, len(job.chunks), len(job.microbatches), schedule,
                        job.holds if schedule in ZERO_BUBBLE else None)
    tables = [forward_only_table(spec)] * spec.pp if job.forward_only else build_tables(spec)
    store = job.weight_grads
    if store is None and spec.split_backward and not job.forward_only:
        store = WeightGradStore()
    return run_table(tables, replace(job, stages=spec.stages, weight_grads=store))
