"""Fixtures shared by every test module."""

from __future__ import annotations

import pytest

from megalite.parallel.groups import NCCL_SEMANTICS_ENV


@pytest.fixture(scope="module", params=["gloo", "nccl_semantics"])
def p2p_semantics(request):
    """Run a pipeline test twice: on plain gloo, and with MEGALITE_NCCL_SEMANTICS=1 (NCCL's point-to-point
    rules emulated on gloo). Module-scoped, so the module's shared runs are redone in each mode; the
    harness and the CLI helpers hand the variable to the ranks they start."""
    patch = pytest.MonkeyPatch()
    if request.param == "nccl_semantics":
        patch.setenv(NCCL_SEMANTICS_ENV, "1")
    else:
        patch.delenv(NCCL_SEMANTICS_ENV, raising=False)
    yield request.param
    patch.undo()
