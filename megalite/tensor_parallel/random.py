"""Model-parallel RNG: dropout in TP-sharded regions must differ per TP rank, elsewhere match.

The default device generator is seeded per pipeline stage (seed + 100 * pp_rank) and is shared by the
TP ranks of a stage (replicated activations get identical masks). A tracked generator seeded with
seed + 2718 + tp_rank is swapped in for sharded regions (attention probabilities over split heads).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from megalite import device

MODEL_PARALLEL_RNG = "model-parallel-rng"


class RNGTracker:
    """Named generator states that can be forked into for a region of code."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        saved = device.get_rng_state()
        device.manual_seed(seed)
        self.states[name] = device.get_rng_state()
        device.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self.states:
            raise KeyError(f"RNG state '{name}' was never added to the tracker")
        saved = device.get_rng_state()
        device.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = device.get_rng_state()
            device.set_rng_state(saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}


CP_SEED_OFFSET = 7919  # a prime well past any pipeline or tensor-parallel offset


def model_parallel_seed(seed: int, tp_rank: int, pp_rank: int, cp_rank: int = 0) -> RNGTracker:
    """Seed the default generator for this stage and return a tracker for TP-sharded regions. Context-
    parallel ranks hold different tokens, so they draw different dropout masks (an offset per CP rank)."""
    device.manual_seed(seed + 100 * pp_rank + CP_SEED_OFFSET * cp_rank)
    tracker = RNGTracker()
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank + CP_SEED_OFFSET * cp_rank)
    return tracker


def hidden_dropout(x: torch.Tensor, p: float, tracker: RNGTracker, sequence_parallel: bool) -> torch.Tensor:
    """Dropout of hidden states [s, b, h] (p = 0: none). Sequence-parallel activations are sharded along
    the sequence, so their masks come from the tracked generator and differ per TP rank; replicated
    activations take the stage's default generator, identical on every TP rank."""
    if p == 0.0:
        return x
    with tracker.fork() if sequence_parallel else contextlib.nullcontext():
        return F.dropout(x, p, training=True)
