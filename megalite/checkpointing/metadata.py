"""What every checkpoint writer shares: the model config it records, the safetensors files, and
metadata.json. Training's save (save.py) and the offline writer (writer.py) both go through here, so a
checkpoint looks the same whoever wrote it."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
from safetensors.torch import save_file

from megalite import __version__
from megalite.checkpointing.canonical import sort_metadata
from megalite.checkpointing.checksum import file_checksum
from megalite.checkpointing.reader import CheckpointError
from megalite.config.flags import domain_errors
from megalite.config.model import ModelConfig

FORMAT_VERSION = 1
OPTIM_FIELDS = ("main", "exp_avg", "exp_avg_sq")  # the tensors an optimizer file holds per parameter


def config_dict(cfg: ModelConfig, vocab_size: int) -> dict[str, Any]:
    """The ``config`` a checkpoint records: the model config plus the true vocab size."""
    return {**dataclasses.asdict(cfg), "vocab_size": vocab_size}


def model_config(config: dict[str, Any]) -> tuple[ModelConfig, int]:
    """(ModelConfig, true vocab size) from a checkpoint's ``config`` metadata (unknown keys ignored); every
    size in its declared domain (the flags' own check), so no layout rule divides by a size of 0 or -8."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    if "vocab_size" not in config:
        raise CheckpointError("checkpoint metadata config has no vocab_size")
    try:
        cfg = ModelConfig(**{k: v for k, v in config.items() if k in names})
    except (TypeError, ValueError, ArithmeticError) as e:  # values of the wrong type
        raise CheckpointError(f"checkpoint metadata config cannot describe a model: {e}") from None
    errors = domain_errors(cfg)
    if errors:
        raise CheckpointError("model config out of its domain: " + "; ".join(errors))
    return cfg, int(config["vocab_size"])


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU as a whole, contiguous tensor of its own (safetensors refuses shared storage),
    copying only when it is not one already."""
    t = t.detach().cpu()
    whole = t._base is None and t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole else t.clone(memory_format=torch.contiguous_format)


def _fsync(path: str) -> None:
    with open(path, "rb") as f:  # durable before the commit renames the directory
        os.fsync(f.fileno())


def save_tensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> str:
    """One safetensors file, made durable (the commit that follows must never expose a partial file).
    Returns its checksum, which metadata.json records."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({k: _owned(v) for k, v in tensors.items()}, path, metadata=metadata)
    sort_metadata(path)  # the same bytes whoever writes the same tensors
    _fsync(path)
    return file_checksum(path)


def layout_meta(*, world_size: int | None, tp: int, pp: int, dp: int, vp: int, order: str,
                distributed_optimizer: bool, cp: int = 1, ep: int = 1, etp: int | None = None,
                chunk_layers: list[list[list[int]]] | None = None) -> dict[str, Any]:
    """metadata.json's ``layout``: what the files were cut for (world_size None: written offline, no RNG).
    With context parallelism the distributed optimizer's files are one per DP x CP rank; ``ep`` and ``etp``
    (default TP) are how the routed experts' files are cut (expert parallel, expert tensor parallel);
    ``chunk_layers``: per pipeline rank, per model chunk, its global layer numbers (the placement: even or
    uneven, round-robin or a V), which tells a resuming run whether its stages hold the same layers."""
    out = {"world_size": world_size, "tp": tp, "pp": pp, "dp": dp, "cp": cp, "vp": vp, "order": order,
           "distributed_optimizer": distributed_optimizer, "ep": ep, "etp": tp if etp is None else etp}
    return out if chunk_layers is None else {**out, "chunk_layers": chunk_layers}


def chunk_layer_numbers(chunk: Any) -> list[int]:
    """The global layer numbers a model chunk holds (its ``layers`` are keyed by them)."""
    return sorted(int(k) for k in chunk.layers)


def write_metadata(staged: str, *, iteration: int, layout: dict[str, Any], config: dict[str, Any],
                   state: dict[str, Any], device: str, extra: dict[str, Any] | None = None,
                   checksums: dict[str, str] | None = None) -> None:
    """metadata.json of the checkpoint being written in ``staged``; ``checksums`` maps each tensor
    file's path relative to the iteration directory to its ``file_checksum`` (a file whose checksum was not
    taken, None, is not listed: the reader checks only what is listed)."""
    meta = {"format_version": FORMAT_VERSION, "megalite_version": __version__, "iteration": iteration,
            "layout": layout, "config": config, "state": state, "device": device, **(extra or {}),
            "checksums": dict(sorted((k, v) for k, v in (checksums or {}).items() if v is not None))}
    path = os.path.join(staged, "metadata.json")
    with open(path, "w") as f:
        json.dump(meta, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
