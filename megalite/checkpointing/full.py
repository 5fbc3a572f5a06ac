"""The meeting point of every checkpoint format: a layout-free full checkpoint.

Every offline reader returns one and every offline writer takes one, so a conversion is reader -> Full ->
writer and a reshard is the same path with megalite's reader and writer at both ends:

    reader                                           -> Full ->   writer
    full_reader.FullCheckpoint(dir).full()  (megalite)            writer.write_full         (megalite, any layout)
    megatron.read.read_megatron(dir).full() (Megatron-LM)         megatron/torch_dist/writer.save_torch_dist
    hf.convert: from_hf_config + from_hf_state_dict (HF)          megatron/legacy/writer.save_legacy
                                                                  hf.convert.to_hf_state_dict (HF)

A Full holds the model ``config`` (megalite's checkpoint config: ModelConfig fields + the true vocab size),
each parameter's full tensor by megalite's layout-free key (``param(key)``, read lazily where the source
allows), the training ``state`` (iteration, consumed samples...), optionally the Adam state as full fp32
tensors (``optimizer``) and the saved RNG states (``rng``, which only a run at the saving layout restores:
the writers leave them out, and a written checkpoint's run seeds afresh).

``--load`` inside a run does not go through a Full: each rank reads only its own slices (load.py reads them
straight from the files when the layout is unchanged, else cuts them from the same full tensors;
megatron/load.py cuts them from a Megatron-LM checkpoint's Full-shaped read).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class OptimizerSource:
    """Full fp32 optimizer tensors: ``get(key, field)`` for field in main/exp_avg/exp_avg_sq, and Adam's step."""

    get: Callable[[str, str], torch.Tensor]
    step: float


@dataclass
class Full:
    """A checkpoint with no layout: what every reader gives and every writer takes (module docstring)."""

    config: dict[str, Any]  # the checkpoint config (metadata.model_config reads it)
    param: Callable[[str], torch.Tensor]  # megalite key (``layers.3.attention.qkv.weight``) -> full tensor
    iteration: int = 0
    state: dict[str, Any] = field(default_factory=dict)  # consumed_samples, valid_consumed, ... (metadata.json's)
    optimizer: OptimizerSource | None = None  # None: weights only
    tokenizer: dict[str, Any] | None = None  # the tokenizer flags the source was trained with, if it records them
    layout: dict[str, Any] = field(default_factory=dict)  # the layout it was read from: a record, for messages
    rng: Any = None  # the saved RNG states (valid only at ``layout``); writers leave them out
    source: str = "megalite"  # the format it was read from: megalite, torch_dist, torch, hf
