"""Fixtures shared by every test module."""

from __future__ import annotations

import pytest

from megalite.parallel.groups import NCCL_SEMANTICS_ENV


@pytest.fixture(scope="module", params=["gloo", "nccl_semantics"])
def p2p_semantics(request):
    """Run a test twice: on plain gloo, and with MEGALITE_NCCL_SEMANTICS=1 (NCCL's point-to-point and
    communicator rules emulated on gloo). Module-scoped, so the module's shared runs are redone in each mode;
    the harness and the CLI helpers hand the variable to the ranks they start. For the cheap tests; the
    long multi-rank ones run every layout under NCCL semantics and one also on plain gloo
    (tests/layouts.py), or, where no layout is special, everything under NCCL semantics (``nccl_semantics``)."""
    patch = pytest.MonkeyPatch()
    if request.param == "nccl_semantics":
        patch.setenv(NCCL_SEMANTICS_ENV, "1")
    else:
        patch.delenv(NCCL_SEMANTICS_ENV, raising=False)
    yield request.param
    patch.undo()


@pytest.fixture
def nccl_semantics(monkeypatch):
    """MEGALITE_NCCL_SEMANTICS=1 for the ranks the test starts: NCCL's rules are stricter than gloo's, and the
    numbers are the same, so a multi-rank run that passes here needs no plain-gloo twin."""
    monkeypatch.setenv(NCCL_SEMANTICS_ENV, "1")
