"""Checkpoints without a training run: read any checkpoint as full tensors, write one at any layout.

``tools/convert_checkpoint.py`` (reshard, to-hf, from-hf) and ``bench/bench_checkpoint.py`` use this.
A written checkpoint has the same files and metadata as a saved one, so ``--load`` and
CheckpointReader read it, and it is committed atomically (staging directory, then rename).

Which parameters a (pipeline rank, model chunk) holds, under which layout-free keys and with which
ShardSpec, is taken from the model itself: a GPTModel of that stage is built on the meta device (no
memory, no init) with process groups that only carry the layout's sizes. So this file knows nothing
about the model's structure and stays right when the model changes.

Optimizer state is written as DP rank 0 owning every element ([0, numel) regions), layout dp=1; the
loader rebuilds tensors from regions, so it loads into any DP size, distributed optimizer or not.
RNG states are not written: like any load into a new layout, the run seeds them fresh. The layout's
``world_size`` is null (the DP size is chosen at launch), which is also what tells the loader that
there are no RNG states to restore.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save_file

from megalite import __version__
from megalite.checkpointing.paths import commit, optim_filename, shard_dirname, staging_dir
from megalite.checkpointing.reader import CheckpointError, CheckpointReader
from megalite.checkpointing.save import FORMAT_VERSION, named_params
from megalite.config.model import ModelConfig
from megalite.model.gpt import GPTModel
from megalite.parallel.groups import GROUP_AXES, ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.pipeline.partition import chunk_layers, num_chunks, virtual_stage
from megalite.tensor_parallel.random import RNGTracker
from megalite.tensor_parallel.sharding import ShardSpec

OPTIM_FIELDS = ("main", "exp_avg", "exp_avg_sq")
STATE_KEYS = ("iteration", "consumed_samples", "valid_consumed", "skipped_iterations", "nan_iterations")


def model_config(config: dict[str, Any]) -> tuple[ModelConfig, int]:
    """(ModelConfig, true vocab size) from a checkpoint's ``config`` metadata (unknown keys ignored)."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    if "vocab_size" not in config:
        raise CheckpointError("checkpoint metadata config has no vocab_size")
    return ModelConfig(**{k: v for k, v in config.items() if k in names}), int(config["vocab_size"])


def config_dict(cfg: ModelConfig, vocab_size: int) -> dict[str, Any]:
    """The ``config`` metadata of a checkpoint (as training's save writes it)."""
    return {**dataclasses.asdict(cfg), "vocab_size": vocab_size}


def layout_errors(cfg: ModelConfig, tp: int, pp: int, layers_per_virtual_stage: int | None = None) -> list[str]:
    """Why the model cannot be cut into this (TP, PP, VP) layout (empty when it can)."""
    errors = []
    if tp <= 0 or pp <= 0:
        return [f"--tensor-model-parallel-size ({tp}) and --pipeline-model-parallel-size ({pp}) must be positive"]
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
    if heads % tp:
        errors.append(f"--tensor-model-parallel-size ({tp}) must divide --num-attention-heads ({heads})")
    if groups % tp and tp % groups:
        errors.append(f"--num-query-groups ({groups}) and --tensor-model-parallel-size ({tp}) must divide one "
                      "another")
    ffn = cfg.ffn_hidden_size
    if ffn % tp:
        errors.append(f"--tensor-model-parallel-size ({tp}) must divide --ffn-hidden-size ({ffn})")
    if cfg.num_layers % pp:
        errors.append(f"--pipeline-model-parallel-size ({pp}) must divide --num-layers ({cfg.num_layers})")
    k = layers_per_virtual_stage
    if k is not None:
        if pp == 1:
            errors.append("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
        elif k <= 0 or cfg.num_layers % (pp * k):
            errors.append(f"--num-layers ({cfg.num_layers}) must be divisible by --pipeline-model-parallel-size "
                          f"({pp}) x --num-layers-per-virtual-pipeline-stage ({k})")
    return errors


def _sizes_only_groups(tp: int, pp: int) -> ProcessGroups:
    """ProcessGroups of rank 0 of a (tp, pp) layout without any communicator: enough to build a model
    on the meta device (layers only read the sizes) and never used to communicate."""
    layout = RankLayout(tp * pp, tp, pp)
    pg = ProcessGroups(layout, 0)
    for kind, axes in GROUP_AXES.items():
        pg.ranks[kind], pg.groups[kind] = layout.group_of(0, axes), None
    pg.ranks["embd"], pg.groups["embd"] = next(g for g in layout.embedding_groups() if 0 in g), None
    return pg


@dataclass(frozen=True)
class StoredParam:
    key: str  # layout-free name, e.g. "layers.3.attention.qkv.weight"
    spec: ShardSpec  # how the full tensor is cut over TP (at this layout's TP size)


def stage_params(config: dict[str, Any], tp: int, pp: int, vp: int = 1) -> list[list[StoredParam]]:
    """For each pipeline rank, the parameters its ``model.safetensors`` holds (all its chunks), in the
    order a training run stores them. A tied output layer on the last stage is not stored."""
    cfg, vocab = model_config(config)
    pg = _sizes_only_groups(tp, pp)
    tracker = RNGTracker()
    last = pp * vp - 1
    stages = []
    for rank in range(pp):
        chunks = []
        for c in range(vp):
            stage = virtual_stage(rank, c, pp)
            chunks.append(GPTModel(cfg, pg, vocab, tracker, device=torch.device("meta"),
                                   layer_numbers=chunk_layers(cfg.num_layers, pp, vp, rank, c),
                                   pre_process=stage == 0, post_process=stage == last))
        stages.append([StoredParam(k, p.shard_spec) for n, k, p in named_params(chunks) if n == k])
    return stages


def all_specs(config: dict[str, Any], tp: int) -> dict[str, ShardSpec]:
    """Every stored parameter's ShardSpec at TP size ``tp``."""
    return {p.key: p.spec for stage in stage_params(config, tp, 1) for p in stage}


# ---- reading ----------------------------------------------------------------------------------


class FullCheckpoint:
    """A checkpoint of any layout, read one full tensor at a time (lazily, from mmapped safetensors)."""

    def __init__(self, load_dir: str, iteration: int | None = None) -> None:
        self.load_dir = load_dir
        self.reader = CheckpointReader(load_dir, iteration)
        self.config: dict[str, Any] = self.reader.config
        self.iteration = self.reader.iteration
        self.state: dict[str, Any] = dict(self.reader.state)
        self.layout: dict[str, Any] = dict(self.reader.meta["layout"])
        self._specs = all_specs(self.config, self.reader.tp)
        saved, expected = set(self.reader.keys()), set(self._specs)
        if saved != expected:
            missing, extra = sorted(expected - saved)[:5], sorted(saved - expected)[:5]
            raise CheckpointError(f"{self.reader.dir}: its parameters do not match its model config "
                                  f"(missing {missing}, unexpected {extra})")

    def keys(self) -> list[str]:
        return list(self._specs)

    def param(self, key: str) -> torch.Tensor:
        return self.reader.full_param(key, self._specs[key])

    def has_optimizer(self) -> bool:
        return self.reader.has_optimizer()

    def optimizer_step(self) -> float:
        return self.reader.optimizer_step()

    def optim(self, key: str, field: str) -> torch.Tensor:
        return self.reader.full_optim(key, field, self._specs[key])

    def params(self) -> dict[str, torch.Tensor]:
        """Every parameter, full (the whole model in memory)."""
        return {k: self.param(k) for k in self.keys()}


# ---- writing ----------------------------------------------------------------------------------


@dataclass
class OptimizerSource:
    """Full fp32 optimizer tensors: ``get(key, field)`` for field in main/exp_avg/exp_avg_sq."""

    get: Callable[[str, str], torch.Tensor]
    step: float


def write_checkpoint(save_dir: str, config: dict[str, Any], get_param: Callable[[str], torch.Tensor], *,
                     tp: int, pp: int, layers_per_virtual_stage: int | None = None,
                     optimizer: OptimizerSource | None = None, iteration: int = 0,
                     state: dict[str, Any] | None = None, note: dict[str, Any] | None = None,
                     dtype: torch.dtype | None = None) -> str:
    """Write a checkpoint of the model ``config`` at layout (tp, pp, vp) from full tensors.

    ``get_param(key)`` returns the full tensor of a layout-free key. Stage by stage, every tensor is
    read once, cut for every TP rank and written, so at most one pipeline stage is held in memory.
    Nothing is visible in ``save_dir`` until the whole checkpoint is committed. Returns its directory."""
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
    try:
        for pp_rank, stored in enumerate(stages):
            _write_stage(staged, pp_rank, stored, tp, get_param, optimizer, dtype)
    except BaseException:  # a bad source shard or an interrupt: leave nothing behind
        shutil.rmtree(staged, ignore_errors=True)
        if created and not os.listdir(save_dir):
            os.rmdir(save_dir)
        raise
    meta = {"format_version": FORMAT_VERSION, "megalite_version": __version__, "iteration": iteration,
            "layout": {"world_size": None, "tp": tp, "pp": pp, "dp": 1, "vp": vp, "order": "tp-cp-dp-pp",
                       "distributed_optimizer": False},
            "config": config, "state": {**{k: 0 for k in STATE_KEYS}, **(state or {}), "iteration": iteration},
            "device": "cpu", "written_by": note or {}}
    path = os.path.join(staged, "metadata.json")
    with open(path, "w") as f:
        json.dump(meta, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    return commit(save_dir, iteration)


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` if it is a whole, contiguous tensor of its own (safetensors refuses shared storage), else a copy."""
    t = t.detach()
    whole = t._base is None and t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole else t.clone(memory_format=torch.contiguous_format)


def _save(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    """Like save.py's writer (durable before the commit), copying only tensors that share storage."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({k: _owned(v) for k, v in tensors.items()}, path, metadata=metadata)
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write_stage(staged: str, pp_rank: int, stored: Iterable[StoredParam], tp: int,
                 get_param: Callable[[str], torch.Tensor], optimizer: OptimizerSource | None,
                 dtype: torch.dtype | None) -> None:
    stored = list(stored)
    weights: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for p in stored:
        full = get_param(p.key)
        if dtype is not None:
            full = full.to(dtype)
        for r in range(tp):
            weights[r][p.key] = p.spec.shard(full, r, tp)
    for r in range(tp):
        _save(weights[r], os.path.join(staged, shard_dirname(r, pp_rank), "model.safetensors"),
              {"format": "megalite-model"})
    del weights
    if optimizer is None:
        return
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
        _save(tensors[r], os.path.join(staged, shard_dirname(r, pp_rank), optim_filename(0)),
              {"format": "megalite-optim", "meta": json.dumps(meta)})


def reshard(load_dir: str, save_dir: str, tp: int, pp: int, layers_per_virtual_stage: int | None = None, *,
            iteration: int | None = None, with_optimizer: bool = True) -> str:
    """Write the checkpoint in ``load_dir`` at another (TP, PP, VP) layout into ``save_dir``: weights,
    optimizer state (when saved and ``with_optimizer``), iteration and training state."""
    if os.path.abspath(save_dir) == os.path.abspath(load_dir):
        raise ValueError(f"--save {save_dir} must differ from --load (a reshard never overwrites its source)")
    src = FullCheckpoint(load_dir, iteration)
    cfg, _ = model_config(src.config)
    errors = layout_errors(cfg, tp, pp, layers_per_virtual_stage)
    if errors:
        raise ValueError(f"--load {load_dir} cannot be resharded to TP={tp} PP={pp}:\n  " + "\n  ".join(errors))
    optimizer = None
    if with_optimizer and src.has_optimizer():
        optimizer = OptimizerSource(src.optim, src.optimizer_step())
    note = {"tool": "convert_checkpoint.py reshard", "source": os.path.abspath(load_dir),
            "source_layout": src.layout}
    return write_checkpoint(save_dir, src.config, src.param, tp=tp, pp=pp,
                            layers_per_virtual_stage=layers_per_virtual_stage, optimizer=optimizer,
                            iteration=src.iteration, state=src.state, note=note)
