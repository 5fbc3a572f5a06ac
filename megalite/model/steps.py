"""What the pipeline runs for a GPT: one micro-batch through one chunk, and the shape passed between stages."""

from __future__ import annotations

import torch
from torch import nn

from megalite.model.gpt import GPTModel


def lm_forward_step(chunk: nn.Module, mb: dict[str, torch.Tensor], hidden: torch.Tensor | None) -> torch.Tensor:
    """One micro-batch through one chunk: hidden states out, or the mean token loss on the last stage."""
    assert isinstance(chunk, GPTModel)
    if not chunk.post_process:
        return chunk(mb["tokens"] if chunk.pre_process else None, hidden=hidden)
    per_token = chunk(mb["tokens"] if chunk.pre_process else None, labels=mb["labels"], hidden=hidden)
    mask = mb["loss_mask"]
    return (per_token.float() * mask).sum() / mask.sum()


def hidden_shape(chunk: GPTModel, tokens: torch.Tensor, tp_size: int) -> tuple[int, int, int]:
    """[s, b, h] of the hidden states between stages for ``tokens`` [b, s] (s / tp with sequence parallelism)."""
    b, s = tokens.shape
    return (s // (tp_size if chunk.sequence_parallel else 1), b, chunk.cfg.hidden_size)
