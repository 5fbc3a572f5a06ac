"""The multi-rank harness itself: results come back in rank order, a failing rank is named with its
traceback, and a rank that dies is reported at once instead of waiting for the timeout."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks


def _sum(rank: int, world: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t)


def _raise_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("bad shape on purpose")


def _die_on_one(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)
    time.sleep(0.2)


def test_results_in_rank_order():
    assert run_ranks(_sum, 4) == [10.0] * 4


def test_failing_rank_is_named_with_traceback():
    with pytest.raises(RuntimeError, match=r"rank 1 failed:(.|\n)*bad shape on purpose"):
        run_ranks(_raise_on_one, 2)


def test_dead_rank_is_reported_without_waiting_for_timeout():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks \[1\] exited without a result"):
        run_ranks(_die_on_one, 2, timeout=120)
    assert time.monotonic() - start < 60


def test_port_taken_before_the_store_binds_is_tried_again(monkeypatch):
    """The port race CI met: the port chosen is taken by the time rank 0's store binds it. The ranks
    start again on a new port instead of failing the test with EADDRINUSE."""
    from tests import harness

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        ports = iter([held.getsockname()[1]])
        real = harness.free_port
        monkeypatch.setattr(harness, "free_port", lambda: next(ports, None) or real())
        assert run_ranks(_sum, 2) == [3.0, 3.0]


def test_free_port_is_outside_the_ephemeral_range():
    from tests.harness import free_port

    assert all(20000 <= free_port() < 32000 for _ in range(20))
