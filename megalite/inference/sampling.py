"""Choosing the next token from logits: greedy, or temperature -> top-k -> top-p, then a seeded draw.

The order and the filtering rules are Hugging Face's logits warpers (and Megatron's sampler): the
temperature divides the logits first; top-k keeps every token whose logit is at least the k-th
largest; top-p keeps the most likely tokens until their probability mass reaches p (a token goes
when the tokens more likely than it already hold p; the most likely one always stays). The draw
uses an explicit ``torch.Generator``, so a seed fixes the samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megalite.config.domain import FP32_TINY


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. ``greedy`` (or temperature 0, or top_k 1) takes the argmax."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 0.0  # 0 or 1: off

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0 or 0 < self.temperature < FP32_TINY:
            raise ValueError(f"--temperature must be >= 0 and finite (0 is greedy), and not below {FP32_TINY:.2g} "
                             f"(the least normal fp32 number) unless 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"--top-p must be in [0, 1], got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0 or self.top_k == 1


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 logits [b, V] after temperature, top-k and top-p (removed tokens are -inf)."""
    logits = logits.float()
    if params.temperature != 1.0:
        scaled = logits / params.temperature
        # a small temperature can overflow fp32 (inf - inf in softmax is NaN): its limit, the argmax, is kept
        overflow = (torch.isinf(scaled) & torch.isfinite(logits)).any(dim=-1, keepdim=True)
        if overflow.any():
            top = torch.where(logits == logits.amax(dim=-1, keepdim=True), 0.0, float("-inf"))
            scaled = torch.where(overflow, top, scaled)
        logits = scaled
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        mass_before = sorted_logits.softmax(dim=-1).cumsum(dim=-1) - sorted_logits.softmax(dim=-1)
        remove_sorted = mass_before >= params.top_p  # the mass before a token already reaches p
        remove_sorted[..., 0] = False
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Next tokens [b] (int64) from logits [b, V]."""
    if params.is_greedy:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, params).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
