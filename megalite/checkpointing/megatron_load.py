"""``--load`` of a Megatron-LM checkpoint folder: its weights straight into this run's model, any layout.

Every rank reads the checkpoint as full tensors (megatron.py) and keeps its own shard of each
(``local_shard``), as the offline import would write them, and so does the Adam state megatron.py
reads (torch_dist's model-space state, the distributed optimizer's dp_reshardable buckets, the legacy
files' numbered one and their distrib_optim.pt); where the checkpoint holds none it reads, the run must
say it starts a fresh optimizer (``--no-load-optim`` keeps the iteration and consumed samples,
``--finetune`` starts from 0).
The model flags must describe the checkpoint's model, each differing shape flag named.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megalite import device
from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.load import LoadedState, check_config, load_optimizer_state
from megalite.checkpointing.megatron import MegatronCheckpoint, read_megatron
from megalite.checkpointing.stored import named_params
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.param_meta import local_shard, param_meta


@torch.no_grad()
def load_megatron(load_dir: str, chunks: list[nn.Module], pg: ProcessGroups, model_config: dict[str, Any],
                  *, weights_only: bool, optimizer: Any = None, rng_now: dict[str, torch.Tensor] | None = None
                  ) -> tuple[LoadedState, dict[str, torch.Tensor] | None, str]:
    """Copy this rank's shards of the Megatron-LM checkpoint in ``load_dir`` into ``chunks`` and, unless
    ``weights_only``, its Adam state into ``optimizer`` (refused, with the reason, when it holds none
    megalite reads); with ``rng_now`` (this run's RNG states), also the RNG states to restore and a note."""
    vocab = model_config.get("vocab_size")
    src = read_megatron(load_dir, vocab_size=None if vocab is None else int(vocab))
    if not weights_only and src.optimizer is None:
        raise CheckpointError(f"--load {load_dir} is a Megatron-LM checkpoint whose optimizer state does not load "
                              f"({src.optimizer_note}); pass --no-load-optim (keeps its iteration) or --finetune")
    check_config(src.config, model_config, f"--load {load_dir} (Megatron-LM, {src.format})")
    for _, key, p in named_params(chunks):
        p.copy_(_local(load_dir, src.params, key, p, pg).to(p.dtype))
    if not weights_only and optimizer is not None:
        state = src.optimizer or {}

        def shard(key: str, field: str, p: nn.Parameter) -> torch.Tensor:
            full = state.get(field, {}).get(key)
            return _local(load_dir, {key: src.params[key].float() if full is None else full}, key, p, pg)

        load_optimizer_state(chunks, optimizer, shard, src.optimizer_step)
    rng, note = megatron_rng(src, pg, rng_now) if rng_now is not None else (None, "RNG states not loaded")
    return LoadedState(src.iteration, src.state, same_layout=False), rng, note


def megatron_rng(src: MegatronCheckpoint, pg: ProcessGroups, current: dict[str, torch.Tensor]
                 ) -> tuple[dict[str, torch.Tensor] | None, str]:
    """This rank's RNG states in megalite's names (``cpu``, ``device``, ``tracker/<name>``) from the legacy
    file of its (TP, PP) rank, or None and why. Megatron-LM and megalite seed and name the same generators
    (the default one per stage, ``model-parallel-rng`` per TP rank), so its states continue its streams;
    a state of another generator kind (a CUDA state on a CPU run) is left as it is. Read only at the
    layout it was saved at, as megalite's own RNG states are."""
    if not src.rng:
        return None, "no RNG state read (only the legacy format's files hold it as plain values)"
    saved = tuple(max(k[i] for k in src.rng) + 1 for i in range(2))  # the files' own (TP, PP) grid
    if saved != (pg.tp_size, pg.pp_size):
        return None, f"RNG states not restored (saved at TP {saved[0]} x PP {saved[1]}, this run's layout differs)"
    states = src.rng.get((pg.tp_rank, pg.pp_rank))
    state = states[min(pg.dp_rank, len(states) - 1)] if isinstance(states, list) and states else states
    cpu = state.get("torch_rng_state") if isinstance(state, dict) else None
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8:
        return None, "RNG states not restored (the file's rng_state holds no torch_rng_state byte tensor)"
    dev = state.get("cuda_rng_state")
    if device.device_type() == "cpu":  # the device generator is the CPU one
        dev = cpu
    out = {"cpu": cpu, "device": dev if _same_kind(dev, current["device"]) else current["device"]}
    trackers = state.get("rng_tracker_states") or {}
    for key, now in current.items():
        if key.startswith("tracker/"):
            saved_state = trackers.get(key.removeprefix("tracker/"))
            out[key] = saved_state if _same_kind(saved_state, now) else now
    kept = [k for k in out if k != "cpu" and out[k] is current[k]]
    return out, "RNG states restored" + (f" (this run's {', '.join(kept)} kept: another generator kind)"
                                         if kept else "")


def _same_kind(saved: Any, now: torch.Tensor) -> bool:
    """A saved generator state that the current generator can take (the same byte size: CPU vs CUDA differ)."""
    return isinstance(saved, torch.Tensor) and saved.dtype == torch.uint8 and saved.numel() == now.numel()


def _local(load_dir: str, full: dict[str, torch.Tensor], key: str, p: nn.Parameter, pg: ProcessGroups) -> torch.Tensor:
    """This rank's shard of ``full[key]`` for parameter ``p``, shaped as it."""
    if key not in full:
        raise CheckpointError(f"--load {load_dir}: the Megatron-LM checkpoint has no {key}")
    local = local_shard(param_meta(p), full[key], pg)
    if local.numel() != p.numel():
        raise CheckpointError(f"--load {load_dir}: {key}: this rank's shard has {local.numel()} elements, "
                              f"the parameter {p.numel()}")
    return local.view(p.shape)
