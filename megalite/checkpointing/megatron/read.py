"""A Megatron-LM checkpoint folder (``--save`` of Megatron-LM) as megalite's config and full tensors.

    DIR/latest_checkpointed_iteration.txt     "1000", or "release"
    DIR/iter_0001000/ (or DIR/release/)       torch_dist: metadata.json, common.pt, .metadata, __R_N.distcp
                                              legacy torch: mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt

Both formats are read without unpickling anything outside an allow-list (safe_pickle.py), checked file by
file, and mapped to megalite's names (names.py); the model config comes from the saved ``args``
(args.py). ``tools/convert_checkpoint.py from-megatron`` writes the result as a megalite
checkpoint at any layout; ``--load`` of a Megatron folder does the same in-process (load.py's caller).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.full import Full, OptimizerSource
from megalite.checkpointing.megatron.args import config_from_args
from megalite.checkpointing.megatron.buffer import main_mismatch
from megalite.checkpointing.megatron.names import (
    check_params,
    split_optimizer_keys,
    to_megalite,
)
from megalite.checkpointing.megatron.rng import SavedRng, dist_rng, legacy_rng
from megalite.checkpointing.paths import RELEASE, TRACKER, check_recorded_iteration, tracked_dir

TOKENIZER_ARGS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")


def iteration_folder(load_dir: str, iteration: int | None = None) -> tuple[str, int]:
    """(the iteration folder to read, its iteration: 0 for ``release``) from the tracker or ``iteration``:
    megalite's one tracker reader and iteration-folder rule (paths.tracked_dir), which also takes the
    ``release`` a Megatron-LM tracker may hold."""
    folder, it = tracked_dir(load_dir, iteration, release=True)
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder} is missing (named by {os.path.join(load_dir, TRACKER)})")
    return folder, 0 if it == RELEASE else int(it)


def checkpoint_format(folder: str) -> str | None:
    """'torch_dist', 'torch' (legacy) or None for an iteration folder Megatron-LM did not write."""
    if os.path.isfile(os.path.join(folder, ".metadata")) or os.path.isfile(os.path.join(folder, "common.pt")):
        return "torch_dist"
    if glob.glob(os.path.join(folder, "mp_rank_*", "model_optim_rng.pt")):
        return "torch"
    return None


def is_megatron_checkpoint(load_dir: str) -> bool:
    """Whether ``load_dir`` holds a Megatron-LM checkpoint (tracker + an iteration folder of its files)."""
    try:
        folder, _ = iteration_folder(load_dir)
    except CheckpointError:
        return False
    return checkpoint_format(folder) is not None


@dataclass
class MegatronCheckpoint:
    """What an import needs: megalite's model ``config``, the full ``params``, the training state, and what
    was (or was not) read of its optimizer and RNG states; ``full()`` is it as the layout-free Full that
    every writer takes (full.py), the same shape as a megalite checkpoint's FullCheckpoint.full()."""

    folder: str
    format: str
    config: dict[str, Any]
    params: dict[str, torch.Tensor]
    iteration: int
    state: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, Any] = field(default_factory=dict)  # the TP / PP sizes it was saved at (from its args)
    tokenizer: dict[str, Any] | None = None  # the run's tokenizer flags (megalite's names are Megatron-LM's)
    optimizer: dict[str, dict[str, torch.Tensor]] | None = None  # field (exp_avg, exp_avg_sq, main) -> key -> full
    optimizer_step: float = 0.0  # Adam's step count (its bias correction)
    optimizer_note: str = "the checkpoint holds no optimizer state"  # why ``optimizer`` is None
    rng: SavedRng | None = None  # each saved rank's rng_state (rng.py), read when a run restores it
    rng_note: str = "the checkpoint holds no RNG state"  # why ``rng`` is None

    def optimizer_source(self) -> OptimizerSource | None:
        """The imported Adam state as full fp32 tensors by megalite key (the main parameters: Megatron's
        fp32_param where it kept one, else the weights themselves), or None when none was read."""
        if self.optimizer is None:
            return None
        state = self.optimizer

        def get(key: str, name: str) -> torch.Tensor:
            if name == "main" and key not in state.get("main", {}):
                return self.params[key].float()
            return state[name][key]

        return OptimizerSource(get, self.optimizer_step)

    def full(self, with_optimizer: bool = True) -> Full:
        """This checkpoint as the layout-free Full every writer takes (full.py); ``optimizer`` when read and
        ``with_optimizer``."""
        return Full(self.config, self.params.__getitem__, self.iteration, self.state,
                    self.optimizer_source() if with_optimizer else None, self.tokenizer, self.layout, self.rng,
                    self.format)


def _vocab(args: Any, rows: int, vocab_size: int | None, where: str) -> int:
    """The true vocabulary: given, else the args' ``vocab_size``, else the (padded) embedding rows."""
    vocab = vocab_size or getattr(args, "vocab_size", None) or rows
    if vocab > rows:
        raise CheckpointError(f"{where}: vocab size {vocab} exceeds the embedding's {rows} rows")
    return int(vocab)


def _recorded_iteration(common: dict[str, Any], folder: str, it: int, where: str) -> int:
    """The iteration the checkpoint records, which must be its folder's (iter_N named by the tracker or
    --iteration); a ``release/`` folder has no number to agree with: its recorded one, else 0."""
    recorded = common.get("iteration")
    if os.path.basename(folder) == RELEASE:
        if recorded is not None and (type(recorded) is not int or recorded < 0):
            raise CheckpointError(f"{where}: records iteration {recorded!r:.40}, not an integer >= 0")
        return recorded or 0
    if recorded is not None:
        check_recorded_iteration(recorded, it, where, "the saved 'iteration'")
    return it


def _state(common: dict[str, Any], args: Any, iteration: int) -> dict[str, Any]:
    consumed = common.get("consumed_train_samples", getattr(args, "consumed_train_samples", 0)) or 0
    valid = getattr(args, "consumed_valid_samples", 0) or 0
    return {"iteration": iteration, "consumed_samples": int(consumed), "valid_consumed": int(valid)}


def read_megatron(load_dir: str, iteration: int | None = None, vocab_size: int | None = None
                  ) -> MegatronCheckpoint:
    """Read the Megatron-LM checkpoint in ``load_dir`` (the tracker's iteration, or ``iteration``)."""
    folder, it = iteration_folder(load_dir, iteration)
    fmt = checkpoint_format(folder)
    if fmt == "torch_dist":
        from megalite.checkpointing.megatron.torch_dist.reader import DistCheckpoint

        src = DistCheckpoint(folder)
        common, keys, get, where = src.common, src.keys(), src.tensor, os.path.join(folder, ".metadata")
    elif fmt == "torch":
        from megalite.checkpointing.megatron.legacy.reader import LegacyCheckpoint

        src = LegacyCheckpoint(folder)
        common, keys, get, where = src.common, src.keys(), src.tensor, src.where
    else:
        raise CheckpointError(f"{folder}: neither a torch_dist checkpoint (.metadata, common.pt) nor a legacy "
                              "one (mp_rank_*/model_optim_rng.pt)")
    args = common.get("args")
    keys, optim_keys, other = split_optimizer_keys(keys)
    params = to_megalite(keys, get, where)
    emb = params.get("embedding.word.weight")
    if emb is None:
        raise CheckpointError(f"{where}: has no embedding.word_embeddings.weight")
    config = config_from_args(args, _vocab(args, emb.shape[0], vocab_size, where), where)
    params = check_params(params, config, where)
    recorded_in = os.path.join(folder, "common.pt") if fmt == "torch_dist" else \
        f"{folder} (TP 0, PP 0's model_optim_rng.pt)"
    it = _recorded_iteration(common, folder, it, recorded_in)
    layout = {"tp": getattr(args, "tensor_model_parallel_size", None),
              "pp": getattr(args, "pipeline_model_parallel_size", None)}
    tokenizer = {k: getattr(args, k, None) for k in TOKENIZER_ARGS} if getattr(args, "tokenizer_type", None) else None
    out = MegatronCheckpoint(folder, fmt, config, params, it, _state(common, args, it), layout, tokenizer)
    out.optimizer_note = getattr(src, "optimizer_note", out.optimizer_note)
    _rng(out, src)
    if other and not optim_keys:
        _dp_reshardable(out, src, keys, other, args, where)
    elif optim_keys:
        out.optimizer, out.optimizer_step = _optimizer(optim_keys, get, common, config, where)
        out.optimizer_note = f"Adam state of step {out.optimizer_step:g} imported"
    return out


def _rng(out: MegatronCheckpoint, src: Any) -> None:
    """Where the saved RNG states lie: the legacy files' (read with them) or torch_dist's byte items."""
    if out.format == "torch_dist":
        got = dist_rng(src)
        out.rng, out.rng_note = (None, got) if isinstance(got, str) else (got, out.rng_note)
    else:
        out.rng = legacy_rng(src.rng)


def _dp_reshardable(out: MegatronCheckpoint, src: Any, keys: list[str], other: list[str], args: Any,
                    where: str) -> None:
    """The distributed optimizer's default bucket-flat state (torch_dist/dp_optim.py) into ``out``, or the note
    why it is not read (the weights are imported either way): every weight must have its fp32 main
    parameter, equal to it, so a buffer cut by another parameter order is refused, never read wrong."""
    from megalite.checkpointing.megatron.torch_dist.dp_optim import dp_reshardable_state

    got = dp_reshardable_state(src, keys, args) if hasattr(src, "object") else "not a torch_dist folder"
    if not isinstance(got, str):
        fields, step = got
        try:
            state = {name: _state_field(name, list(tensors), tensors.__getitem__, out.config, where)
                     for name, tensors in fields.items()}
            frozen = _not_optimized(out.config)
            wrong = main_mismatch(state.get("main", {}), {k: t for k, t in out.params.items() if k not in frozen})
            got = f"{wrong}: megatron-core's layout not matched" if wrong else (state, step)
        except CheckpointError as e:
            got = str(e)
    if isinstance(got, str):
        out.optimizer_note = (f"its optimizer state is the distributed optimizer's dp_reshardable buffers "
                              f"({other[0]}: Megatron-LM's default, laid out by its gradient buckets), which is "
                              f"not read ({got}); save with --dist-ckpt-optim-fully-reshardable to import it")
        return
    out.optimizer, out.optimizer_step = got
    out.optimizer_note = f"Adam state of step {out.optimizer_step:g} imported (dp_reshardable)"


def _optimizer(fields: dict[str, dict[str, str]], get: Any, common: dict[str, Any], config: dict[str, Any],
               where: str) -> tuple[dict[str, dict[str, torch.Tensor]], float]:
    """The optimizer state of torch_dist's model-space keys as megalite's full tensors per field, and the
    step count from common.pt."""
    missing = [f for f in ("exp_avg", "exp_avg_sq") if f not in fields]
    if missing:
        raise CheckpointError(f"{where}: its optimizer state has no {missing[0]} (Adam's moments are read)")
    out = {name: _state_field(name, list(keys), lambda k, source=keys: get(source[k]), config, where)
           for name, keys in fields.items()}
    return out, _optimizer_step(common.get("optimizer") or {}, where)


def _not_optimized(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The parameters without optimizer state (the router's expert bias: megatron-core's buffer, megalite's
    frozen parameter, moved by its own rule) and their full shapes."""
    from megalite.checkpointing.megatron.names import full_shapes
    from megalite.checkpointing.stored import stage_params

    frozen = {p.key for stage in stage_params(config, 1) for p in stage if not p.optimized}
    return {k: s for k, s in full_shapes(config).items() if k in frozen} if frozen else {}


def _state_field(name: str, keys: list[str], get: Any, config: dict[str, Any], where: str) -> dict[str, torch.Tensor]:
    """One optimizer field's full fp32 tensors under megalite's keys, from megatron-core's ``keys``
    (``get(key)``), each checked as a parameter is: every parameter with optimizer state, its full shape, the
    padding dropped."""
    frozen = _not_optimized(config)
    params = {**{k: torch.empty(s, device="meta") for k, s in frozen.items()}, **to_megalite(keys, get, where)}
    checked = check_params(params, config, f"{where} (optimizer {name})")
    return {k: t.float() for k, t in checked.items() if k not in frozen}


def _optimizer_step(saved: dict[str, Any], where: str) -> float:
    """Adam's step count: the non-distributed optimizer's ``state.common_step``, or the distributed
    optimizer's per-group ``step`` (fully_reshardable: under ``optimizer.optimizer``), which must agree; a
    ChainedOptimizer (an MoE run's dense and expert optimizers) saves one such dict per optimizer under its
    index, and every one must hold the same step (megatron-core makes them equal before it saves)."""
    chained = bool(saved) and all(isinstance(k, int) for k in saved)
    steps = {_one_step(saved[k], f"{where}: common.pt's optimizer {k}") for k in sorted(saved)} if chained else \
        {_one_step(saved, f"{where}: common.pt's optimizer")}
    if len(steps) != 1:
        raise CheckpointError(f"{where}: common.pt's chained optimizers hold different step counts {sorted(steps)} "
                              "(megalite keeps one)")
    return steps.pop()


def _one_step(saved: Any, where: str) -> float:
    """One optimizer's step count (see _optimizer_step)."""
    saved = saved if isinstance(saved, dict) else {}
    if "param_state_sharding_type" in saved and isinstance(saved.get("optimizer"), dict):
        saved = saved["optimizer"]
    step = (saved.get("state") or {}).get("common_step")
    groups = [g.get("step") for g in saved.get("param_groups") or [] if isinstance(g, dict)]
    steps = {float(s) for s in ([step] if step is not None else groups) if isinstance(s, torch.Tensor | int | float)}
    if len(steps) != 1 or not min(steps) >= 0:
        raise CheckpointError(f"{where} holds no single step count (common_step {step!r}, the groups' steps "
                              f"{groups[:4]})")
    return steps.pop()
