"""Write a checkpoint at any layout from full tensors, without a training run.

A written checkpoint has the same files and metadata as a saved one, so ``--load`` and CheckpointReader
read it, and it is committed atomically (staging directory, then rename).

Optimizer state is written as DP rank 0 owning every element ([0, numel) regions), layout dp=1; the
loader rebuilds tensors from regions, so it loads into any DP size, distributed optimizer or not.
Routed experts' weights go to expert_rank_TT_EEE_PPP folders cut at (expert-TP, EP) = (etp, ep).
RNG states are not written: like any load into a new layout, the run seeds them fresh. The layout's
``world_size`` is null (the DP size is chosen at launch), which is also what tells the loader that
there are no RNG states to restore.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
from safetensors import SafetensorError

from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.full import Full, OptimizerSource
from megalite.checkpointing.metadata import OPTIM_FIELDS, layout_meta, model_config, save_tensors, write_metadata
from megalite.checkpointing.paths import commit, family_dirname, optim_filename, staging_dir
from megalite.checkpointing.stored import StoredParam, stage_params
from megalite.config.flags import domain_errors
from megalite.config.parallel import ParallelConfig
from megalite.config.validate import layout_errors
from megalite.parallel.groups import Group
from megalite.parallel.placement import LayerSplit
from megalite.pipeline.partition import num_chunks
from megalite.tensor_parallel.param_meta import FAMILIES, ParamFamily

STATE_KEYS = ("iteration", "consumed_samples", "valid_consumed", "skipped_iterations", "nan_iterations")


def expert_errors(config: dict[str, Any], ep: int, etp: int) -> list[str]:
    """Why the model's routed experts cannot be cut over EP ``ep`` x expert-TP ``etp`` (empty when they can)."""
    cfg, _ = model_config(config)
    if ep <= 0 or etp <= 0:
        return [f"--expert-model-parallel-size ({ep}) and --expert-tensor-parallel-size ({etp}) must be positive"]
    if not cfg.is_moe:
        return [] if ep == 1 else ["--expert-model-parallel-size needs a model with --num-experts"]
    errors = []
    if cfg.num_experts % ep:
        errors.append(f"--expert-model-parallel-size ({ep}) must divide --num-experts ({cfg.num_experts})")
    if cfg.expert_ffn_hidden_size % etp:
        errors.append(f"--expert-tensor-parallel-size ({etp}) must divide the expert hidden size "
                      f"(--moe-ffn-hidden-size {cfg.expert_ffn_hidden_size})")
    return errors


def write_full(save_dir: str, full: Full, *, tp: int, pp: int, with_optimizer: bool = True,
               extra: dict[str, Any] | None = None, **layout: Any) -> str:
    """Write the layout-free checkpoint ``full`` (full.py, what every reader returns) at layout (tp, pp, ...):
    its weights, its optimizer state unless ``with_optimizer`` is False, its iteration, training state and
    recorded tokenizer. ``layout``: write_checkpoint's other keywords (layers_per_virtual_stage, ep, etp,
    split, note, dtype). Every conversion and every reshard ends here."""
    kept = {"tokenizer": full.tokenizer} if full.tokenizer else {}
    return write_checkpoint(save_dir, full.config, full.param, tp=tp, pp=pp,
                            optimizer=full.optimizer if with_optimizer else None, iteration=full.iteration,
                            state=full.state, extra={**kept, **(extra or {})} or None, **layout)


def write_checkpoint(save_dir: str, config: dict[str, Any], get_param: Callable[[str], torch.Tensor], *,
                     tp: int, pp: int, layers_per_virtual_stage: int | None = None, ep: int = 1,
                     etp: int | None = None,
                     optimizer: OptimizerSource | None = None, iteration: int = 0,
                     state: dict[str, Any] | None = None, note: dict[str, Any] | None = None,
                     dtype: torch.dtype | None = None, extra: dict[str, Any] | None = None,
                     split: LayerSplit | None = None) -> str:
    """Write a checkpoint of the model ``config`` at layout (tp, pp, vp) from full tensors; ``split`` (its pp
    must be ``pp``): an uneven or V placement of the layers instead of the even round-robin one.

    ``get_param(key)`` returns the full tensor of a layout-free key. Stage by stage, every tensor is
    read once, cut for every TP rank (routed experts: every EP x expert-TP rank, ``etp`` default ``tp``) and
    written, so at most one pipeline stage is held in memory.
    Nothing is visible in ``save_dir`` until the whole checkpoint is committed. ``extra`` goes into
    metadata.json as is (e.g. the source's ``tokenizer`` entry). Returns its directory."""
    cfg, _ = model_config(config)
    errors = domain_errors(ParallelConfig(  # the sizes in their flags' domains before any rule divides by them
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, num_layers_per_virtual_pipeline_stage=layers_per_virtual_stage))
    etp = tp if etp is None else etp
    if split is None and not errors:
        split = LayerSplit(cfg.num_layers, pp, max(num_chunks(cfg.num_layers, pp, layers_per_virtual_stage), 1))
    if split is not None and split.pp != pp:
        errors = [f"the layer split is for {split.pp} pipeline stages, not --pipeline-model-parallel-size {pp}"]
    errors = errors or layout_errors(cfg, tp, pp, layers_per_virtual_stage, split) + expert_errors(config, ep, etp)
    if errors:
        raise ValueError(f"cannot write {save_dir} at TP={tp} PP={pp}:\n  " + "\n  ".join(errors))
    sizes = {Group.TP: tp, Group.ETP: etp, Group.EP: ep}  # the groups families cut and split over
    stages = stage_params(config, tp, split)
    created = not os.path.exists(save_dir)
    staged = staging_dir(save_dir, iteration)
    shutil.rmtree(staged, ignore_errors=True)
    os.makedirs(staged)
    checksums: dict[str, str] = {}
    try:
        for pp_rank, stored in enumerate(stages):
            for family in FAMILIES.values():
                mine = [p for p in stored if p.family == family]
                if mine:
                    checksums.update(_write_family(staged, pp_rank, mine, family, sizes, get_param, optimizer, dtype))
        layout = layout_meta(world_size=None, tp=tp, pp=pp, dp=1, vp=split.vp, order="tp-cp-dp-pp",
                             distributed_optimizer=False, ep=ep, etp=etp, chunk_layers=split.chunk_table())
        write_metadata(staged, iteration=iteration, layout=layout, config=config,
                       state={**{k: 0 for k in STATE_KEYS}, **(state or {}), "iteration": iteration}, device="cpu",
                       extra={**(extra or {}), "written_by": note or {}}, checksums=checksums)
        return commit(save_dir, iteration)
    except BaseException as e:  # a bad source shard, a full disk or an interrupt: leave nothing behind
        shutil.rmtree(staged, ignore_errors=True)
        if created and os.path.isdir(save_dir) and not os.listdir(save_dir):
            os.rmdir(save_dir)
        if isinstance(e, SafetensorError):  # safetensors' own write error (a full disk): not an OSError
            raise CheckpointError(f"--save {save_dir}: writing iteration {iteration} failed ({e}); its staging "
                                  "directory was removed") from None
        raise


def _cut(full: torch.Tensor, p: StoredParam, r: int, cut: int, e: int, blocks: int) -> torch.Tensor:
    """Shard (r of ``cut``) of split block (e of ``blocks``) of a full tensor; blocks = 1 when not split."""
    return p.spec.shard(p.family.block(full, e, blocks), r, cut)


def _write_folders(staged: str, folders: dict[tuple[int, int], str], stored: list[StoredParam],
                   get_param: Callable[[str], torch.Tensor], optimizer: OptimizerSource | None,
                   dtype: torch.dtype | None) -> dict[str, str]:
    """Write ``stored``'s shards: ``folders[(r, e)]`` is the folder of shard r of split block e (the grid's
    sizes are the largest indices + 1). Returns the checksums of the files written."""
    cut, blocks = max(r for r, _ in folders) + 1, max(e for _, e in folders) + 1
    sums: dict[str, str] = {}
    weights: dict[tuple[int, int], dict[str, torch.Tensor]] = {c: {} for c in folders}
    for p in stored:
        full = get_param(p.key)
        if dtype is not None:
            full = full.to(dtype)
        for r, e in folders:
            weights[(r, e)][p.key] = _cut(full, p, r, cut, e, blocks)
    for c, folder in folders.items():
        rel = os.path.join(folder, "model.safetensors")
        sums[rel] = save_tensors(weights[c], os.path.join(staged, rel), {"format": "megalite-model"})
    del weights
    if optimizer is None:
        return sums
    tensors: dict[tuple[int, int], dict[str, torch.Tensor]] = {c: {} for c in folders}
    regions: dict[tuple[int, int], dict[str, list]] = {c: {} for c in folders}
    for p in (p for p in stored if p.optimized):
        for field in OPTIM_FIELDS:
            full = optimizer.get(p.key, field).float()
            for r, e in folders:
                local = _cut(full, p, r, cut, e, blocks)
                tensors[(r, e)][f"{p.key}/{field}"] = local.reshape(-1)
                regions[(r, e)][p.key] = [0, local.numel(), list(local.shape)]
    for c, folder in folders.items():
        meta = {"regions": regions[c], "step": float(optimizer.step)}
        rel = os.path.join(folder, optim_filename(0))
        sums[rel] = save_tensors(tensors[c], os.path.join(staged, rel),
                                 {"format": "megalite-optim", "meta": json.dumps(meta)})
    return sums


def _write_family(staged: str, pp_rank: int, stored: list[StoredParam], family: ParamFamily, sizes: dict[str, int],
                  get_param: Callable[[str], torch.Tensor], optimizer: OptimizerSource | None,
                  dtype: torch.dtype | None) -> dict[str, str]:
    """Write one pipeline stage's files of ``family`` for every rank of its shard x split groups (their
    ``sizes``): every TP rank's dense files, every (expert-TP, EP) rank's routed experts' files."""
    cut, blocks = sizes[family.shard], sizes[family.split] if family.split is not None else 1
    folders = {(r, e): family_dirname(family, r, e, pp_rank) for e in range(blocks) for r in range(cut)}
    return _write_folders(staged, folders, stored, get_param, optimizer, dtype)
