"""save_checkpoint(): every rank writes its own shard files in parallel into a staging directory;
rank 0 commits the directory and the tracker only after all ranks finished (atomic)."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from megalite import __version__, device
from megalite.checkpointing.paths import commit, optim_filename, rng_filename, shard_dirname, staging_dir
from megalite.parallel.groups import ProcessGroups

FORMAT_VERSION = 1


def checkpoint_key(name: str, param: nn.Parameter) -> str:
    """The layout-free name a parameter is stored under (the last stage's tied embedding copy is the
    embedding itself, stored once by the first stage)."""
    return getattr(param, "init_name", name)


def named_params(chunks: list[nn.Module]) -> list[tuple[str, str, nn.Parameter]]:
    """(module name, checkpoint key, parameter) of every parameter of this rank's chunks."""
    return [(n, checkpoint_key(n, p), p) for c in chunks for n, p in c.named_parameters()]


def _save(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()}, path, metadata=metadata)
    with open(path, "rb") as f:  # durable before the commit renames the directory
        os.fsync(f.fileno())
    return path


def optimizer_tensors(chunks: list[nn.Module], optimizer: Any) -> tuple[dict[str, torch.Tensor], dict]:
    """fp32 main params and Adam moments of the flat slices this rank owns, with their regions."""
    key_of = {id(p): k for n, k, p in named_params(chunks) if n == k}
    tensors: dict[str, torch.Tensor] = {}
    regions: dict[str, list] = {}
    step = 0.0
    for e in optimizer.entries:
        key = key_of.get(id(e.param))
        if key is None:  # the tied copy: its state equals the embedding's, stored by the first stage
            continue
        state = optimizer.adam.state.get(e.main, {})
        tensors[f"{key}/main"] = e.main
        for field in ("exp_avg", "exp_avg_sq"):
            tensors[f"{key}/{field}"] = state.get(field, torch.zeros_like(e.main))
        step = float(state.get("step", step))
        regions[key] = [e.lo, e.hi, list(e.param.shape)]
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
        _save(weights, os.path.join(shard, "model.safetensors"), {"format": "megalite-model"})
    if optimizer is not None and (optimizer.distributed or pg.dp_rank == 0):
        tensors, meta = optimizer_tensors(chunks, optimizer)
        _save(tensors, os.path.join(shard, optim_filename(pg.dp_rank if optimizer.distributed else 0)),
              {"format": "megalite-optim", "meta": json.dumps(meta)})
    _save(rng_states, os.path.join(staged, rng_filename(pg.rank)))
    if pg.rank == 0:
        layout = pg.layout
        meta = {"format_version": FORMAT_VERSION, "megalite_version": __version__, "iteration": iteration,
                "layout": {"world_size": layout.world_size, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp,
                           "vp": len(chunks), "order": layout.order,
                           "distributed_optimizer": bool(optimizer is not None and optimizer.distributed)},
                "config": config, "state": state, "device": device.device_type(), **(extra_meta or {})}
        with open(os.path.join(staged, "metadata.json"), "w") as f:
            json.dump(meta, f, indent=1, default=str)
    pg.barrier()
    if pg.rank == 0:
        commit(save_dir, iteration)
    pg.barrier()
    return os.path.join(save_dir, f"iter_{iteration:07d}")

