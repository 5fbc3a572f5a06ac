"""What tools/soak.py does to a checkpoint folder between launches (flip bytes in a shard, garble or delete
the tracker) and what it checks at the end (every checkpoint ever complete still there or set aside,
the final weights bitwise equal to the uninterrupted run's)."""

from __future__ import annotations

import glob
import os
import random

import torch
from safetensors.torch import load_file

from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.fallback import iterations_on_disk, problem
from megalite.checkpointing.paths import TRACKER, iter_dirname, read_tracker


def passing(folder: str) -> list[int]:
    """Iterations in ``folder`` that pass the checks a restart makes (newest first)."""
    return [i for i in iterations_on_disk(folder) if problem(folder, i) is None]


def complete(folder: str) -> set[int]:
    """Iterations whose folder was committed (an ``iter_N`` with its metadata.json)."""
    return {i for i in iterations_on_disk(folder)
            if os.path.isfile(os.path.join(folder, iter_dirname(i), "metadata.json"))}


def tracked(folder: str) -> int | None:
    """The iteration the tracker names, or None (missing or garbled)."""
    try:
        return read_tracker(folder)
    except CheckpointError:
        return None


def corrupt_newest(folder: str, rng: random.Random) -> str:
    """Flip 16 bytes in one tensor file of the newest checkpoint; returns its path relative to ``folder``."""
    try:
        newest = read_tracker(folder)  # the one a restart loads
    except CheckpointError:
        newest = passing(folder)[0]
    files = sorted(glob.glob(os.path.join(folder, iter_dirname(newest), "**", "*.safetensors"), recursive=True))
    path = rng.choice(files)
    size = os.path.getsize(path)
    at = rng.randrange(8, max(9, size - 16))
    with open(path, "r+b") as f:
        f.seek(at)
        data = f.read(16)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in data))
        f.flush()
        os.fsync(f.fileno())
    return os.path.relpath(path, folder)


def damage_tracker(folder: str, rng: random.Random) -> str:
    """Delete the tracker or overwrite it with bytes that are no iteration number; returns which."""
    path = os.path.join(folder, TRACKER)
    if rng.random() < 0.5 and os.path.isfile(path):  # an earlier fault may have deleted it already: garble then
        os.remove(path)
        return "deleted"
    with open(path, "wb") as f:
        f.write(rng.choice([b"\x00\x17garbage\xff", b"", b"4O\n", b"-12\n"]))
    return "garbled"


def missing_checkpoints(folder: str, ever: set[int], notices: list[str]) -> list[str]:
    """Each iteration once complete that is neither in ``folder`` nor set aside there with a notice."""
    names = os.listdir(folder)
    lost = []
    for it in sorted(ever):
        name = iter_dirname(it)
        if name in names:
            continue
        aside = [n for n in names if n.startswith(f"{name}.corrupt-")]
        if not aside or not any(f"set aside as {aside[0]}" in n for n in notices):
            lost.append(name + (f" (set aside as {aside[0]} without a notice)" if aside else ""))
    return lost


def compare_final(folder: str, reference: str, iteration: int) -> tuple[bool, str]:
    """Whether every tensor file of ``iteration`` in both folders holds the same tensors, bit for bit."""
    mine = os.path.join(folder, iter_dirname(iteration))
    theirs = os.path.join(reference, iter_dirname(iteration))
    rel = sorted(os.path.relpath(p, mine) for p in glob.glob(os.path.join(mine, "**", "*.safetensors"),
                                                            recursive=True))
    other = sorted(os.path.relpath(p, theirs) for p in glob.glob(os.path.join(theirs, "**", "*.safetensors"),
                                                                recursive=True))
    if not rel or rel != other:
        return False, f"different files: {rel} vs {other}"
    tensors = 0
    for name in rel:
        a, b = load_file(os.path.join(mine, name)), load_file(os.path.join(theirs, name))
        if sorted(a) != sorted(b):
            return False, f"{name}: different tensor names"
        for key in a:
            x, y = a[key], b[key]
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(_bits(x), _bits(y)):
                return False, f"{name}: {key} differs"
            tensors += 1
    return True, f"{len(rel)} files, {tensors} tensors bitwise equal (weights, optimizer state, RNG states)"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
