"""What the dense and the MoE Hugging Face mappings share: the conversion error, one tensor's rule, and
how a RoPE base is written to an HF config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


class HFConversionError(ValueError):
    """A model or folder that cannot be converted; the message says which feature or file."""


def rope_theta(value: float) -> int | float:
    """HF writes an integral RoPE base as an int (10000, not 10000.0)."""
    return int(value) if float(value).is_integer() else float(value)


def _same(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (t,)


def transposed(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous()


@dataclass(frozen=True)
class TensorRule:
    """One megalite tensor and the HF tensor(s) it becomes. ``split`` maps ours to theirs (to HF),
    ``join`` theirs back to ours (from HF). ``zeros_like_rows_of``: megalite has no such tensor but HF
    needs one: it is exported as zeros with as many rows as that megalite tensor, and not imported."""

    ours: str
    theirs: tuple[str, ...]
    split: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] = _same
    join: Callable[..., torch.Tensor] = lambda t: t
    zeros_like_rows_of: str | None = None
