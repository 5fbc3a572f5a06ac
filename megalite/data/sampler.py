"""Which sample indices each rank reads: a pure function of consumed samples and the layout.

The global order is ``0, 1, 2, ...`` of the (already shuffled) dataset, whatever the layout; a global
batch of ``global_batch_size`` consecutive indices is cut into micro-batches of
``micro_batch_size * dp`` consecutive indices, and DP rank r takes the r-th ``micro_batch_size`` slice
of each (Megatron's pretraining sampler order). Resuming from ``consumed_samples`` continues exactly.
"""

from __future__ import annotations


def microbatch_indices(consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                       dp_rank: int, dp_size: int) -> list[list[int]]:
    """Sample indices of this DP rank's micro-batches for the global batch starting at
    ``consumed_samples``."""
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step:
        raise ValueError(f"global batch {global_batch_size} is not divisible by "
                         f"micro-batch {micro_batch_size} x data-parallel {dp_size}")
    out = []
    for start in range(consumed_samples, consumed_samples + global_batch_size, per_step):
        first = start + dp_rank * micro_batch_size
        out.append(list(range(first, first + micro_batch_size)))
    return out
