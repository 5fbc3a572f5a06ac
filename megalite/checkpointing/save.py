"""save_checkpoint(): every rank writes its own shard files in parallel into a staging directory;
rank 0 commits the directory and the tracker only after all ranks finished (atomic)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn

from megalite import device
from megalite.checkpointing.metadata import (
    OPTIM_FIELDS,
    chunk_layer_numbers,
    layout_meta,
    save_tensors,
    write_metadata,
)
from megalite.checkpointing.paths import (
    TRACKER,
    commit,
    family_dirname,
    iter_dirname,
    optim_filename,
    rng_filename,
    staging_dir,
)
from megalite.checkpointing.reader import CheckpointError
from megalite.checkpointing.stored import named_params
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.param_meta import FAMILIES, ParamFamily, param_meta


def optimizer_tensors(chunks: list[nn.Module], optimizer: Any, family: ParamFamily | None = None
                      ) -> tuple[dict[str, torch.Tensor], dict]:
    """fp32 main params and Adam moments of the flat slices this rank owns, with their regions (only the
    parameters of ``family`` when given)."""
    key_of = {id(p): k for n, k, p in named_params(chunks) if n == k}
    slices, step = optimizer.state_tensors()
    tensors: dict[str, torch.Tensor] = {}
    regions: dict[str, list] = {}
    for s in slices:
        key = key_of.get(id(s.param))
        if key is None:  # the tied copy: its state equals the embedding's, stored by the first stage
            continue
        if family is not None and param_meta(s.param).family != family:
            continue
        tensors.update({f"{key}/{field}": s.tensors[field] for field in OPTIM_FIELDS})
        regions[key] = [s.lo, s.hi, list(s.param.shape)]
    return tensors, {"regions": regions, "step": step}


class CheckpointSaveError(CheckpointError):
    """A save failed on some rank; its staging directory is gone and the tracker still names the
    previous checkpoint."""


class CheckpointWriteError(CheckpointSaveError):
    """Writing a save failed on some rank (a full disk, a file-size limit, an I/O error): nothing about
    the run is wrong, so the training loop may go on and try again at the next --save-interval."""


def _agree(pg: ProcessGroups, error: str | None, payload: Any = None) -> list[tuple[str | None, Any]]:
    """Every rank's (error, payload): a barrier that also tells each rank whether another one failed,
    so a failing rank never leaves its peers waiting in a collective it will not join."""
    return pg.all_gather_object((error, payload))


# What writing a file raises: a full disk, a read-only or vanished directory. safetensors reports its own
# write errors (a full disk included) as SafetensorError, which is not an OSError.
WRITE_ERRORS: tuple[type[Exception], ...] = (OSError, SafetensorError)


def _attempt(fn: Callable[[], Any]) -> tuple[str | None, Any]:
    try:
        return None, fn()
    except WRITE_ERRORS as e:  # reported, then cleaned up
        return f"{type(e).__name__}: {e}", None


def _check(results: list, pg: ProcessGroups, save_dir: str, iteration: int) -> None:
    """Raise on every rank when any rank failed, after rank 0 removed the staging directory."""
    failed = [(rank, err) for rank, (err, _) in enumerate(results) if err]
    if not failed:
        return
    if pg.rank == 0:
        shutil.rmtree(staging_dir(save_dir, iteration), ignore_errors=True)
    tracker = os.path.join(save_dir, TRACKER)
    kept = (f"{tracker} still names iteration {open(tracker).read().strip()}" if os.path.isfile(tracker)
            else f"no earlier checkpoint in {save_dir}")
    rank, err = failed[0]
    raise CheckpointWriteError(f"--save {save_dir}: saving iteration {iteration} failed on rank {rank} ({err}); "
                              f"its staging directory was removed and {kept}")


def _first_non_finite(named: list[tuple[str, torch.Tensor]]) -> str | None:
    """Name of the first tensor holding a NaN/inf, or None: one max-abs reduction per tensor (NaN
    propagates through it) and a single host sync for all of them."""
    named = [(k, t) for k, t in named if t.numel()]  # the inf norm needs an element
    if not named:
        return None
    peaks = torch.stack([torch.linalg.vector_norm(t.detach(), float("inf")).float() for _, t in named])
    bad = (~torch.isfinite(peaks)).nonzero()
    return named[int(bad[0])][0] if len(bad) else None


def first_non_finite(chunks: list[nn.Module]) -> str | None:
    """Name of this rank's first parameter holding a NaN/inf, or None."""
    return _first_non_finite([(k, p) for n, k, p in named_params(chunks) if n == k])


def first_non_finite_state(chunks: list[nn.Module], optimizer: Any) -> str | None:
    """'<parameter>/<field>' of this rank's first optimizer tensor (fp32 main param, Adam moment) holding
    a NaN/inf, or None. The moments can go bad while the weights stay finite (an inf second moment turns
    every update into zero), and a checkpoint holding them would poison any run that resumes from it."""
    if optimizer is None:
        return None
    return _first_non_finite(list(optimizer_tensors(chunks, optimizer)[0].items()))


def _refuse_non_finite(chunks: list[nn.Module], optimizer: Any, pg: ProcessGroups, save_dir: str,
                       iteration: int) -> None:
    """Raise on every rank when any rank's weights or optimizer state are not finite: such a checkpoint
    would only resume a broken run. Nothing has been written yet."""
    found = _agree(pg, first_non_finite(chunks), first_non_finite_state(chunks, optimizer))
    bad = [(rank, f"parameter {weight}" if weight else f"optimizer state {state}")
           for rank, (weight, state) in enumerate(found) if weight or state]
    if bad:
        rank, what = bad[0]
        raise CheckpointSaveError(f"--save {save_dir}: refusing to save iteration {iteration}: {what} "
                                  f"on rank {rank} is not finite (NaN/inf); nothing was written (the loss "
                                  "diverged: lower --lr, and keep the default NaN check, i.e. drop "
                                  "--no-check-for-nan-in-loss-and-grad)")


def _shard_files(folder: str, weights: dict[str, torch.Tensor] | None, optim: tuple[dict, dict] | None,
                 optim_rank: int) -> dict[str, tuple[dict, dict | None]]:
    """The files of one shard folder this rank writes: its weights and/or its optimizer slices."""
    files: dict[str, tuple[dict, dict | None]] = {}
    if weights is not None:
        files[os.path.join(folder, "model.safetensors")] = (weights, {"format": "megalite-model"})
    if optim is not None:
        tensors, meta = optim
        files[os.path.join(folder, optim_filename(optim_rank))] = (
            tensors, {"format": "megalite-optim", "meta": json.dumps(meta)})
    return files


RankFiles = dict[str, tuple[dict[str, torch.Tensor], dict | None]]  # path in the iteration -> (tensors, meta)


def rank_files(chunks: list[nn.Module], optimizer: Any, pg: ProcessGroups, rng_states: dict[str, torch.Tensor],
               extra_files: RankFiles | None = None) -> RankFiles:
    """This rank's tensor files (paths relative to the iteration directory), not yet written: the live
    tensors, which a synchronous save writes at once and an asynchronous one copies first.

    Each parameter family's weights (and unsharded optimizer state) are identical over the family's DP
    group and are written by its rank 0 into the family's folder: dense ones over DP x CP into
    mp_rank_TT_PPP, routed experts' over expert-DP into expert_rank_TT_EEE_PPP (TT the expert-TP rank);
    sharded optimizer slices beside them, one file per rank of that group. ``extra_files``: more
    per-rank files (e.g. the gradient-compression state)."""
    stored = [(k, p) for n, k, p in named_params(chunks) if n == k]
    dist_opt = optimizer is not None and optimizer.distributed
    files: RankFiles = {}
    for family in FAMILIES.values():
        mine = {k: p for k, p in stored if param_meta(p).family == family}
        if not mine:
            continue  # e.g. a stage without MoE layers has no expert folder
        folder = family_dirname(family, family.coords(pg)[0], family.split_coords(pg)[0], pg.pp_rank)
        rank = pg.index(family.dp_kind(pg))
        first = rank == 0  # the replica that writes the weights (and the optimizer state unless sharded)
        optim = (optimizer_tensors(chunks, optimizer, family)
                 if optimizer is not None and (dist_opt or first) else None)
        files.update(_shard_files(folder, mine if first else None, optim, rank if dist_opt else 0))
    files[rng_filename(pg.rank)] = (rng_states, None)
    files.update(extra_files or {})
    return files


def write_files(staged: str, files: RankFiles, step: Callable[[str], None] | None = None) -> dict[str, str]:
    """Write (and fsync) ``files`` under ``staged``; returns their checksums by relative path. ``step``
    is told each path once its file is durable (the kill tests' hook)."""
    sums = {}
    for rel, (tensors, meta) in files.items():
        sums[rel] = save_tensors(tensors, os.path.join(staged, rel), meta)
        if step is not None:
            step(rel)
    return sums


def prepare_save(save_dir: str, iteration: int, chunks: list[nn.Module], optimizer: Any, pg: ProcessGroups) -> str:
    """Refuse non-finite state, then rank 0 (re)creates the staging directory and every rank learns its
    name (collectives: the main thread only)."""
    _refuse_non_finite(chunks, optimizer, pg, save_dir, iteration)

    def prepare() -> str:
        staged = staging_dir(save_dir, iteration)  # rank 0's name, unique to this run
        shutil.rmtree(staged, ignore_errors=True)
        os.makedirs(staged)
        return staged

    prepared = _agree(pg, *(_attempt(prepare) if pg.rank == 0 else (None, None)))
    _check(prepared, pg, save_dir, iteration)
    return prepared[0][1]


def save_layout(pg: ProcessGroups, chunks: list[nn.Module], optimizer: Any) -> dict[str, Any]:
    """metadata.json's ``layout`` of this run, with every pipeline rank's chunks' layers (gathered from the
    chunks themselves: every rank calls this, as it calls the rest of the save)."""
    lay = pg.layout
    sharded = bool(optimizer is not None and optimizer.distributed)
    placed = dict(pg.all_gather_object((pg.pp_rank, [chunk_layer_numbers(c) for c in chunks])))
    return layout_meta(world_size=lay.world_size, tp=lay.tp, pp=lay.pp, dp=lay.dp, vp=len(chunks), order=lay.order,
                       distributed_optimizer=sharded, cp=lay.cp, ep=pg.ep_size, etp=pg.etp_size,
                       chunk_layers=[placed[r] for r in range(lay.pp)])


def finish_save(save_dir: str, iteration: int, staged: str, results: list, pg: ProcessGroups,
                meta: dict[str, Any]) -> None:
    """After every rank's files are durable (``results``: every rank's (error, checksums)): raise on
    every rank if one failed; else rank 0 writes metadata.json and commits the directory and the tracker.
    ``meta``: write_metadata's keyword arguments but the checksums."""
    _check(results, pg, save_dir, iteration)

    def finish() -> None:
        checksums = {k: v for _, sums in results for k, v in sums.items()}
        write_metadata(staged, iteration=iteration, checksums=checksums, **meta)
        commit(save_dir, iteration, staged)

    _check(_agree(pg, *(_attempt(finish) if pg.rank == 0 else (None, None))), pg, save_dir, iteration)


def metadata_fields(iteration: int, pg: ProcessGroups, chunks: list[nn.Module], optimizer: Any, config: dict,
                    state: dict[str, Any], extra_meta: dict[str, Any] | None) -> dict[str, Any]:
    """What metadata.json records besides the checksums, fixed at the moment the save is taken."""
    return {"layout": save_layout(pg, chunks, optimizer), "config": config, "state": state,
            "device": device.device_type(), "extra": extra_meta}


def save_checkpoint(save_dir: str, iteration: int, chunks: list[nn.Module], optimizer: Any, pg: ProcessGroups,
                    config: dict, state: dict[str, Any], rng_states: dict[str, torch.Tensor],
                    extra_meta: dict[str, Any] | None = None, extra_files: RankFiles | None = None) -> str:
    """Write iteration ``iteration``; returns the committed directory. All ranks must call it.
    ``extra_meta`` (e.g. the tokenizer the run used) is stored in metadata.json; ``extra_files`` are more
    per-rank tensor files. A failure on any rank (e.g. a full disk) raises CheckpointSaveError on every
    rank and leaves the previous checkpoint as is; so do weights or optimizer state that are not finite,
    before anything is written."""
    staged = prepare_save(save_dir, iteration, chunks, optimizer, pg)
    try:
        files = rank_files(chunks, optimizer, pg, rng_states, extra_files)
        results = _agree(pg, *_attempt(lambda: write_files(staged, files)))
        meta = metadata_fields(iteration, pg, chunks, optimizer, config, state, extra_meta)
        finish_save(save_dir, iteration, staged, results, pg, meta)
    except BaseException:  # e.g. Ctrl-C mid-save: no staging folder is left behind (a kill leaves one; the
        if pg.rank == 0:  # next run's start-up removes it)
            shutil.rmtree(staged, ignore_errors=True)
        raise
    return os.path.join(save_dir, iter_dirname(iteration))
