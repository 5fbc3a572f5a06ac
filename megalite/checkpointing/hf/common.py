"""What every Hugging Face adapter shares and no architecture owns: the conversion error, one tensor's
rule, megalite's QKV interleave, how a RoPE base and RoPE parameters are read and written, and the
training-flag rules a converted config must pass (named by the HF keys they come from)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megalite.checkpointing.config_rules import model_rule_errors
from megalite.config.model import ModelConfig


class HFConversionError(ValueError):
    """A model or folder that cannot be converted; the message says which feature or file."""


def rope_theta(value: float) -> int | float:
    """HF writes an integral RoPE base as an int (10000, not 10000.0)."""
    return int(value) if float(value).is_integer() else float(value)


def rope_parameters(hf_config, kind: str | None = None) -> dict[str, Any]:
    """The RoPE parameters of an HF config as one dict with ``rope_type`` and ``rope_theta``: transformers
    5.x's ``rope_parameters`` (flat, or keyed by layer kind such as ``sliding_attention`` /
    ``full_attention``: pass ``kind``), else 4.x's ``rope_scaling`` with ``rope_theta`` beside it."""
    rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    if kind is not None and isinstance(rope.get(kind), Mapping):
        rope = dict(rope[kind])
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return rope


def _same(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (t,)


def transposed(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous()


def halves(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """megalite's fused [gate; up] rows -> (gate, up)."""
    return tuple(x.contiguous() for x in t.chunk(2, dim=0))


def cat_rows(*parts: torch.Tensor) -> torch.Tensor:
    """Inverse of halves (and of any split into row blocks)."""
    return torch.cat(parts)


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


# ---- the QKV interleave -----------------------------------------------------------------------


def split_qkv(fused: torch.Tensor, heads: int, groups: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megalite's per-group [q_g..., k_g, v_g] rows -> (q [heads*d, ...], k [groups*d, ...], v)."""
    rest = fused.shape[1:]
    x = fused.reshape(groups, heads // groups + 2, head_dim, *rest)
    q = x[:, :-2].reshape(heads * head_dim, *rest)
    k = x[:, -2].reshape(groups * head_dim, *rest)
    v = x[:, -1].reshape(groups * head_dim, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int, head_dim: int
             ) -> torch.Tensor:
    """Inverse of split_qkv: separate q/k/v rows -> megalite's per-group interleave."""
    rest = q.shape[1:]
    per = heads // groups
    blocks = [q.reshape(groups, per, head_dim, *rest), k.reshape(groups, 1, head_dim, *rest),
              v.reshape(groups, 1, head_dim, *rest)]
    return torch.cat(blocks, dim=1).reshape((heads + 2 * groups) * head_dim, *rest).contiguous()


# ---- the training flags' rules ----------------------------------------------------------------------


def check_model_rules(cfg: ModelConfig, hf_config, where: str, keys: Mapping[str, str]) -> None:
    """The model a Hugging Face config describes must pass the rules its training flags would
    (checkpointing/config_rules.py), so that it is refused at conversion, not in training or generation.
    Each error names the HF keys it comes from (``keys``: megalite flag -> HF key, the adapter's), with
    their values."""
    errors = model_rule_errors(cfg)
    if not errors:
        return
    lines = []
    for e in errors:
        named = dict.fromkeys(keys[f] for f in keys if f in e)
        values = ", ".join(f"{k} {getattr(hf_config, k, None)!r}" for k in named)
        lines.append(f"{values}: {e}" if values else e)
    if len(lines) == 1:
        raise HFConversionError(f"{where}: {lines[0]} (the rule of the training flag it maps to)")
    raise HFConversionError(f"{where}: this model breaks the rules of the training flags it maps to:\n  "
                            + "\n  ".join(lines))
