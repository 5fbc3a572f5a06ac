"""The one relative-error assertion the tests share, and a recorder of the largest tensor a path builds."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def assert_rel_close(actual: float | Sequence[float | None], expected: float | Sequence[float | None], rtol: float,
                     what: str = "") -> None:
    """Every value of ``actual`` is within ``rtol`` relative of ``expected`` (same length; a None, e.g.
    the grad norm of a skipped step, must be None in both). The message names ``what``, the worst
    position and both curves."""
    if not isinstance(actual, Sequence):
        actual, expected = [actual], [expected]
    actual, expected = list(actual), list(expected)
    assert len(actual) == len(expected), f"{what}: {len(actual)} values vs {len(expected)}: {actual} vs {expected}"
    worst, at = 0.0, None
    for i, (a, b) in enumerate(zip(actual, expected)):
        if a is None or b is None:
            assert a is None and b is None, f"{what}: position {i}: {a} vs {b}"
            continue
        err = abs(a - b) / max(abs(b), 1e-12)
        if not err <= worst:  # also catches NaN
            worst, at = err, i
    assert worst <= rtol, (f"{what}: relative error {worst:.3e} > {rtol:g} at position {at}: "
                           f"{actual} vs expected {expected}")


class LargestResult(TorchDispatchMode):
    """Records the largest tensor any operation returns while active: its element count and its bytes (what
    a path builds, masks and temporaries included, that saved-tensor hooks would not see)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
                self.nbytes = max(self.nbytes, t.numel() * t.element_size())
        return out
