"""Names of checkpoint files and directories, and the atomic commit of a finished save."""

from __future__ import annotations

import os
import shutil

from megalite.checkpointing.errors import CheckpointError, CheckpointNotFoundError
from megalite.tensor_parallel.param_meta import ParamFamily

TRACKER = "latest_checkpointed_iteration.txt"


def iter_dirname(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def shard_dirname(tp_rank: int, pp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def family_dirname(family: ParamFamily, shard_rank: int, split_rank: int, pp_rank: int) -> str:
    """The folder of a parameter family's files at rank ``shard_rank`` of the group its spec cuts over,
    block ``split_rank`` of its split dim (named only for families that split) and stage ``pp_rank``:
    mp_rank_TT_PPP (dense) or expert_rank_TT_EEE_PPP (routed experts)."""
    split = [f"{split_rank:03d}"] if family.split is not None else []
    return "_".join([family.folder, f"{shard_rank:02d}", *split, f"{pp_rank:03d}"])


def optim_filename(dp_rank: int) -> str:
    return f"optim_dp_{dp_rank:03d}.safetensors"


def rng_filename(rank: int) -> str:
    return os.path.join("rng", f"rank_{rank:05d}.safetensors")


def staging_dir(save_dir: str, iteration: int) -> str:
    """Where ranks write a save in progress; it becomes the iteration directory only once complete."""
    return os.path.join(save_dir, f".{iter_dirname(iteration)}.incomplete")


def read_tracker(load_dir: str) -> int:
    path = os.path.join(load_dir, TRACKER)
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(
            f"--load {load_dir}: no {TRACKER} there; expected a checkpoint directory written by --save "
            f"(holding {TRACKER} and iter_NNNNNNN/ folders)")
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"--load {load_dir}: {TRACKER} holds {text!r}, expected an iteration number")
    return int(text)


def swap_into_place(staged: str, final: str) -> None:
    """Move a finished folder to ``final``; an existing one is removed only after the new one is there."""
    if os.path.exists(final):
        old = final.rstrip("/") + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staged, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staged, final)


def commit(save_dir: str, iteration: int) -> str:
    """Move the complete staging directory into place, then point the tracker at it (each step atomic:
    a crash leaves the previous checkpoint and tracker intact)."""
    final = os.path.join(save_dir, iter_dirname(iteration))
    swap_into_place(staging_dir(save_dir, iteration), final)
    tmp = os.path.join(save_dir, f".{TRACKER}.tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save_dir, TRACKER))
    return final
