"""Pipeline flag rules (kept beside the schedules they protect)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megalite.config.arguments import MegaliteConfig


def pipeline_errors(cfg: "MegaliteConfig") -> list[str]:
    p = cfg.parallel
    errors = []
    if p.pipeline_model_parallel_size > 1:
        errors.append("--pipeline-model-parallel-size > 1 is not implemented yet")
    if p.num_layers_per_virtual_pipeline_stage is not None:
        errors.append("--num-layers-per-virtual-pipeline-stage is not implemented yet")
    return errors
