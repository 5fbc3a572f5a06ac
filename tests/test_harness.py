"""The multi-rank harness itself: results come back in rank order, a failing rank is named with its
traceback, and a rank that dies is reported at once instead of waiting for the timeout."""

from __future__ import annotations

import os
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
