"""NVIDIA apex's fused GPU kernels (Adam, LayerNorm, RMSNorm), used when the real apex is importable.

apex is built from source on GPU machines and is never a dependency. The PyPI package named ``apex``
is an unrelated project, so apex is recognised by the modules megalite uses (``apex.optimizers``,
``apex.normalization.fused_layer_norm``) and their names, never by the top-level name. Looked up lazily,
once per process; anything that fails to import counts as absent, and the callers fall back to torch.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType


@functools.cache
def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - absent, the unrelated PyPI 'apex', or a build that cannot load
        return None


def clear_cache() -> None:
    """Forget earlier look-ups (tests that install or remove a module)."""
    _module.cache_clear()


def fused_adam_class() -> type | None:
    """``apex.optimizers.FusedAdam``, or None without the real apex."""
    return getattr(_module("apex.optimizers"), "FusedAdam", None)


def fused_norm(kind: str, device_type: str) -> Callable | None:
    """apex's fused affine norm for ``kind`` ('LayerNorm' or 'RMSNorm') on CUDA tensors, else None.

    LayerNorm: f(x, weight, bias, shape, eps); RMSNorm: f(x, weight, shape, eps)."""
    if device_type != "cuda":
        return None
    name = "fused_layer_norm_affine" if kind == "LayerNorm" else "fused_rms_norm_affine"
    return getattr(_module("apex.normalization.fused_layer_norm"), name, None)
