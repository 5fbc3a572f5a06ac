"""Promises: the global sample order depends only on consumed samples, never on the layout; each DP
rank takes its slice; resuming from consumed samples continues the exact order."""

from __future__ import annotations

import pytest

from megalite.data.sampler import microbatch_indices


def _global_batch(consumed, gbs, mbs, dp):
    per_rank = [microbatch_indices(consumed, gbs, mbs, r, dp) for r in range(dp)]
    # Micro-batch k of every rank, in rank order, is one contiguous run of mbs * dp indices.
    return [i for k in range(len(per_rank[0])) for r in range(dp) for i in per_rank[r][k]]


@pytest.mark.parametrize("mbs,dp", [(1, 1), (2, 1), (1, 4), (2, 2), (4, 2), (1, 8)])
def test_global_order_is_layout_independent(mbs, dp):
    for consumed in (0, 16, 48):
        assert _global_batch(consumed, 16, mbs, dp) == list(range(consumed, consumed + 16))


def test_resume_continues_the_order():
    order = [i for step in range(4) for i in _global_batch(step * 8, 8, 2, 2)]
    resumed = [i for step in range(2, 4) for i in _global_batch(step * 8, 8, 2, 2)]
    assert order[16:] == resumed


def test_indivisible_batch_is_rejected():
    with pytest.raises(ValueError, match="not divisible"):
        microbatch_indices(0, 10, 4, 0, 2)
