"""save_checkpoint(): every rank writes its own shard files in parallel into a staging directory;
rank 0 commits the directory and the tracker only after all ranks finished (atomic)."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
from torch import nn

from megalite import device
from megalite.checkpointing.metadata import OPTIM_FIELDS, layout_meta, save_tensors, write_metadata
from megalite.checkpointing.paths import commit, optim_filename, rng_filename, shard_dirname, staging_dir
from megalite.checkpointing.stored import named_params
from megalite.parallel.groups import ProcessGroups


def optimizer_tensors(chunks: list[nn.Module], optimizer: Any) -> tuple[dict[str, torch.Tensor], dict]:
    """fp32 main params and Adam moments of the flat slices this rank owns, with their regions."""
    key_of = {id(p): k for n, k, p in named_params(chunks) if n == k}
    slices, step = optimizer.state_tensors()
    tensors: dict[str, torch.Tensor] = {}
    regions: dict[str, list] = {}
    for s in slices:
        key = key_of.get(id(s.param))
        if key is None:  # the tied copy: its state equals the embedding's, stored by the first stage
            continue
        tensors.update({f"{key}/{field}": s.tensors[field] for field in OPTIM_FIELDS})
        regions[key] = [s.lo, s.hi, list(s.param.shape)]
    return tensors, {"regions": regions, "step": step}


def save_checkpoint(save_dir: str, iteration: int, chunks: list[nn.Module], optimizer: Any, pg: ProcessGroups,
                    config: dict, state: dict[str, Any], rng_states: dict[str, torch.Tensor],
                    extra_meta: dict[str, Any] | None = None) -> str:
    """Write iteration ``iteration``; returns the committed directory. All ranks must call it.
    ``extra_meta`` (e.g. the tokenizer the run used) is stored in metadata.json."""
    staged = staging_dir(save_dir, iteration)
    if pg.rank == 0:
        shutil.rmtree(staged, ignore_errors=True)
        os.makedirs(staged)
    pg.barrier()
    shard = os.path.join(staged, shard_dirname(pg.tp_rank, pg.pp_rank))
    if pg.dp_rank == 0:  # weights are identical over DP
        weights = {k: p for n, k, p in named_params(chunks) if n == k}
        save_tensors(weights, os.path.join(shard, "model.safetensors"), {"format": "megalite-model"})
    if optimizer is not None and (optimizer.distributed or pg.dp_rank == 0):
        tensors, meta = optimizer_tensors(chunks, optimizer)
        save_tensors(tensors, os.path.join(shard, optim_filename(pg.dp_rank if optimizer.distributed else 0)),
                     {"format": "megalite-optim", "meta": json.dumps(meta)})
    save_tensors(rng_states, os.path.join(staged, rng_filename(pg.rank)))
    if pg.rank == 0:
        lay = pg.layout
        sharded = bool(optimizer is not None and optimizer.distributed)
        layout = layout_meta(world_size=lay.world_size, tp=lay.tp, pp=lay.pp, dp=lay.dp, vp=len(chunks),
                             order=lay.order, distributed_optimizer=sharded)
        write_metadata(staged, iteration=iteration, layout=layout, config=config, state=state,
                       device=device.device_type(), extra=extra_meta)
    pg.barrier()
    if pg.rank == 0:
        commit(save_dir, iteration)
    pg.barrier()
    return os.path.join(save_dir, f"iter_{iteration:07d}")

