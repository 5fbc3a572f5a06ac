"""Write a checkpoint at any layout from full tensors, without a training run.

A written checkpoint has the same files and metadata as a saved one, so ``--load`` and CheckpointReader
read it, and it is committed atomically (staging directory, then rename).

Optimizer state is written as DP rank 0 owning every element ([0, numel) regions), layout dp=1; the
loader rebuilds tensors from regions, so it loads into any DP size, distributed optimizer or not.
RNG states are not written: like any load into a new layout, the run seeds them fresh. The layout's
``world_size`` is null (the DP size is chosen at launch), which is also what tells the loader that
there are no RNG states to restore.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from megalite.checkpointing.metadata import OPTIM_FIELDS, layout_meta, model_config, save_tensors, write_metadata
from megalite.checkpointing.paths import commit, optim_filename, shard_dirname, staging_dir
from megalite.checkpointing.stored import StoredParam, stage_params
from megalite.config.validate import layout_errors
from megalite.pipeline.partition import num_chunks

STATE_KEYS = ("iteration", "consumed_samples", "valid_consumed", "skipped_iterations", "nan_iterations")


@dataclass
class OptimizerSource:
    """Full fp32 optimizer tensors: ``get(key, field)`` for field in main/exp_avg/exp_avg_sq."""

    get: Callable[[str, str], torch.Tensor]
    step: float


def write_checkpoint(save_dir: str, config: dict[str, Any], get_param: Callable[[str], torch.Tensor], *,
                     tp: int, pp: int, layers_per_virtual_stage: int | None = None,
                     optimizer: OptimizerSource | None = None, iteration: int = 0,
                     state: dict[str, Any] | None = None, note: dict[str, Any] | None = None,
                     dtype: torch.dtype | None = None, extra: dict[str, Any] | None = None) -> str:
    """Write a checkpoint of the model ``config`` at layout (tp, pp, vp) from full tensors.

    ``get_param(key)`` returns the full tensor of a layout-free key. Stage by stage, every tensor is
    read once, cut for every TP rank and written, so at most one pipeline stage is held in memory.
    Nothing is visible in ``save_dir`` until the whole checkpoint is committed. ``extra`` goes into
    metadata.json as is (e.g. the source's ``tokenizer`` entry). Returns its directory."""
    cfg, _ = model_config(config)
    errors = layout_errors(cfg, tp, pp, layers_per_virtual_stage)
    if errors:
        raise ValueError(f"cannot write {save_dir} at TP={tp} PP={pp}:\n  " + "\n  ".join(errors))
    vp = num_chunks(cfg.num_layers, pp, layers_per_virtual_stage)
    stages = stage_params(config, tp, pp, vp)
    created = not os.path.exists(save_dir)
    staged = staging_dir(save_dir, iteration)
    shutil.rmtree(staged, ignore_errors=True)
    os.makedirs(staged)
    checksums: dict[str, str] = {}
    try:
        for pp_rank, stored in enumerate(stages):
            checksums.update(_write_stage(staged, pp_rank, stored, tp, get_param, optimizer, dtype))
        layout = layout_meta(world_size=None, tp=tp, pp=pp, dp=1, vp=vp, order="tp-cp-dp-pp",
                             distributed_optimizer=False)
        write_metadata(staged, iteration=iteration, layout=layout, config=config,
                       state={**{k: 0 for k in STATE_KEYS}, **(state or {}), "iteration": iteration}, device="cpu",
                       extra={**(extra or {}), "written_by": note or {}}, checksums=checksums)
        return commit(save_dir, iteration)
    except BaseException:  # a bad source shard, a full disk or an interrupt: leave nothing behind
        shutil.rmtree(staged, ignore_errors=True)
        if created and os.path.isdir(save_dir) and not os.listdir(save_dir):
            os.rmdir(save_dir)
        raise


def _write_stage(staged: str, pp_rank: int, stored: Iterable[StoredParam], tp: int,
                 get_param: Callable[[str], torch.Tensor], optimizer: OptimizerSource | None,
                 dtype: torch.dtype | None) -> dict[str, str]:
    """Write one pipeline stage's files for every TP rank; returns their checksums (relative paths)."""
    stored = list(stored)
    sums: dict[str, str] = {}
    weights: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for p in stored:
        full = get_param(p.key)
        if dtype is not None:
            full = full.to(dtype)
        for r in range(tp):
            weights[r][p.key] = p.spec.shard(full, r, tp)
    for r in range(tp):
        rel = os.path.join(shard_dirname(r, pp_rank), "model.safetensors")
        sums[rel] = save_tensors(weights[r], os.path.join(staged, rel), {"format": "megalite-model"})
    del weights
    if optimizer is None:
        return sums
    tensors: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    regions: list[dict[str, list]] = [{} for _ in range(tp)]
    for p in stored:
        for field in OPTIM_FIELDS:
            full = optimizer.get(p.key, field).float()
            for r in range(tp):
                local = p.spec.shard(full, r, tp)
                tensors[r][f"{p.key}/{field}"] = local.reshape(-1)
                regions[r][p.key] = [0, local.numel(), list(local.shape)]
    for r in range(tp):
        meta = {"regions": regions[r], "step": float(optimizer.step)}
        rel = os.path.join(shard_dirname(r, pp_rank), optim_filename(0))
        sums[rel] = save_tensors(tensors[r], os.path.join(staged, rel),
                                 {"format": "megalite-optim", "meta": json.dumps(meta)})
    return sums
