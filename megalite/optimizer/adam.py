"""Optional NVIDIA apex fused Adam: used on GPUs when importable, never required.

NVIDIA apex is built from source on GPU machines; the PyPI package named ``apex`` is unrelated, so it is
never a dependency. Without it torch's fused (GPU) or foreach (CPU) AdamW computes the same update.
"""

from __future__ import annotations

from megalite import device


def apex_fused_adam():
    """apex.optimizers.FusedAdam, or None when not on a GPU or apex is not installed."""
    if not device.has_cuda():
        return None
    try:
        from apex.optimizers import FusedAdam
    except ImportError:
        return None
    return FusedAdam
