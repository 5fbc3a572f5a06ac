"""Pipeline flag rules (kept beside the schedules they protect)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megalite.config.arguments import MegaliteConfig


def pipeline_errors(cfg: MegaliteConfig, dp: int) -> list[str]:
    """Messages for every pipeline rule the flags break (empty when valid)."""
    p, t = cfg.parallel, cfg.training
    pp, k, layers = p.pipeline_model_parallel_size, p.num_layers_per_virtual_pipeline_stage, cfg.model.num_layers
    errors = []
    if k is None:
        return errors
    if k <= 0:
        return [f"--num-layers-per-virtual-pipeline-stage must be positive, got {k}"]
    if pp == 1:
        errors.append("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
    if layers % (pp * k):
        errors.append(f"--num-layers ({layers}) must be divisible by --pipeline-model-parallel-size ({pp}) x "
                      f"--num-layers-per-virtual-pipeline-stage ({k})")
        return errors
    vp = layers // (pp * k)
    if vp > 1 and t.global_batch_size and t.micro_batch_size * dp:
        m = t.global_batch_size // (t.micro_batch_size * dp)
        if m % pp:
            errors.append(f"the interleaved schedule needs the number of micro-batches per step ({m} = "
                          f"--global-batch-size {t.global_batch_size} / (--micro-batch-size {t.micro_batch_size} x "
                          f"data-parallel {dp})) to be divisible by --pipeline-model-parallel-size ({pp})")
    return errors
