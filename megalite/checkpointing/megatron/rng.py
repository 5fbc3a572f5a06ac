"""Megatron-LM's saved RNG states, for ``pretrain_gpt.py --load`` of its folder (load.py).

Megatron-LM saves per rank the dict its ``get_rng_state`` collects (``random_rng_state``,
``np_rng_state``, ``torch_rng_state``, ``cuda_rng_state``, ``rng_tracker_states``) in a list: one entry, or
one per DP rank with ``--data-parallel-random-init``. Where it lies:

- legacy: ``rng_state`` of each ``mp_rank_TT[_PPP]`` file, read with the file;
- torch_dist: a ShardedObject ``rng_state`` of global shape (PP, TP) at offset (pp_rank, tp_rank), written by
  DP rank 0 of each TP x PP rank (the other DP ranks are its replicas); with expert parallelism Megatron-LM
  0.16 shapes it (PP, TP, DP x CP) instead, every rank writing its own. Each is a byte item
  ``rng_state/shard_<offset>_<shape>`` of the ``.distcp`` files holding ``torch.save([that list])``; only
  the names are read with the checkpoint, and a rank's item is unpickled (through the allow-list) only when
  a run restores it, so an import that needs no RNG state never unpickles one.

megalite seeds and names the same generators as Megatron-LM (the default generator per stage,
``model-parallel-rng`` per TP rank), so a saved state continues its stream, at the saved layout only.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from itertools import product
from typing import Any

import torch

from megalite import device
from megalite.checkpointing.megatron.safe_pickle import UnsafePickleError
from megalite.parallel.groups import ProcessGroups

KEY = "rng_state"
SHARD = re.compile(rf"^{KEY}/shard_(\d+(?:\.\d+)*)_(\d+(?:\.\d+)*)$")
GRID_NAMES = ("TP", "PP", "DP")


@dataclass
class SavedRng:
    """Each saved rank's ``rng_state`` list, by its coordinate on the saved ``grid``: (TP, PP) sizes, or
    (TP, PP, DP x CP) for torch_dist's per-DP layout; ``read(coordinate)`` gives it (None: not saved)."""

    grid: tuple[int, ...]
    read: Callable[[tuple[int, ...]], Any]


def legacy_rng(per_rank: dict[tuple[int, int], Any]) -> SavedRng | None:
    """The legacy files' ``rng_state`` per (TP, PP) rank, the grid that of the files."""
    if not per_rank:
        return None
    return SavedRng(tuple(max(k[i] for k in per_rank) + 1 for i in range(2)), per_rank.get)


def dist_rng(src: Any) -> SavedRng | str:
    """torch_dist's ``rng_state`` items of ``src`` (a torch_dist/reader.DistCheckpoint) by their names, each
    unpickled when read; or why there are none to read."""
    names = src.object_names(KEY)
    if not names:
        return "the checkpoint holds no rng_state (saved with --no-save-rng)"
    parsed = {n: SHARD.match(n) for n in names}
    bad = [n for n, m in parsed.items() if m is None]
    if bad:
        return f"{bad[0]} is not a ShardedObject name of Megatron-LM's rng_state"
    at = {n: (tuple(map(int, m[1].split("."))), tuple(map(int, m[2].split(".")))) for n, m in parsed.items() if m}
    shapes = {shape for _, shape in at.values()}
    shape = shapes.pop()
    if shapes or len(shape) not in (2, 3):
        return f"its rng_state items have shapes {sorted(shapes | {shape})}, not one (PP, TP[, DP]) grid"
    where = {offset: n for n, (offset, _) in at.items()}
    if sorted(where) != list(product(*map(range, shape))):
        return f"its rng_state items do not cover their (PP, TP[, DP]) grid {shape} once each"

    def read(coord: tuple[int, ...]) -> Any:
        name = where[(coord[1], coord[0], *coord[2:])]  # Megatron-LM's offsets run (PP, TP[, DP])
        try:
            saved = src.object(name)
        except UnsafePickleError as e:
            raise UnsafePickleError(f"{e} (the RNG states: --no-load-rng loads without them)") from None
        return saved[0] if isinstance(saved, list) and len(saved) == 1 else saved  # [the rank's list]

    return SavedRng((shape[1], shape[0], *shape[2:]), read)


def _layout(grid: tuple[int, ...]) -> str:
    return " x ".join(f"{n} {s}" for n, s in zip(GRID_NAMES, grid))


def rng_to_restore(saved: SavedRng | None, why_none: str, pg: ProcessGroups, current: dict[str, torch.Tensor]
                   ) -> tuple[dict[str, torch.Tensor] | None, str]:
    """This rank's RNG states in megalite's names (``cpu``, ``device``, ``tracker/<name>``) from the saved
    state of its rank, or None and why. Read only at the layout it was saved at, as megalite's own RNG
    states are; the DP rank picks its entry of a per-DP list (else the one entry, as Megatron-LM does); a
    state of another generator kind (a CUDA state on a CPU run) is left as this run has it."""
    if saved is None:
        return None, f"no RNG state read ({why_none})"
    run = (pg.tp_size, pg.pp_size, pg.dp_size * pg.cp_size)[:len(saved.grid)]
    if saved.grid != run:
        return None, f"RNG states not restored (saved at {_layout(saved.grid)}, this run's layout differs)"
    states = saved.read((pg.tp_rank, pg.pp_rank, pg.dp_rank * pg.cp_size + pg.cp_rank)[:len(saved.grid)])
    state = states[min(pg.dp_rank, len(states) - 1)] if isinstance(states, list) and states else states
    cpu = state.get("torch_rng_state") if isinstance(state, dict) else None
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8:
        return None, "RNG states not restored (the saved rng_state holds no torch_rng_state byte tensor)"
    dev = cpu if device.device_type() == "cpu" else state.get("cuda_rng_state")  # on the CPU the same generator
    trackers = state.get("rng_tracker_states")
    trackers = trackers if isinstance(trackers, dict) else {}
    saved_as = {"cpu": cpu, "device": dev, **{k: trackers.get(k.removeprefix("tracker/")) for k in current
                                             if k.startswith("tracker/")}}
    out = {k: s if _same_kind(s, current[k]) else current[k] for k, s in saved_as.items()}
    kept = [k for k in out if out[k] is current[k]]
    notes = [f" (this run's {', '.join(ks)} kept: {why})" for why, ks in (
        ("another generator kind", [k for k in kept if saved_as[k] is not None]),
        ("not saved", [k for k in kept if saved_as[k] is None])) if ks]
    return out, "RNG states restored" + "".join(notes)


def _same_kind(saved: Any, now: torch.Tensor) -> bool:
    """A saved generator state that the current generator can take (the same byte size: CPU vs CUDA differ)."""
    return isinstance(saved, torch.Tensor) and saved.dtype == torch.uint8 and saved.numel() == now.numel()
