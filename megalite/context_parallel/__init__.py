"""Context parallelism: a sequence split over the ranks of the CP group, attention computed over all of it.

Each CP rank keeps two of the 2c chunks of every sequence (the zigzag split, ``zigzag.py``); the attention
core (``attention.py``) exchanges keys and values over the CP group by a ring of point-to-point batches
(``ring.py``), all-to-alls (``ulysses.py``) or an all-gather (``all_gather.py``), so that every rank's
output rows equal the full-sequence causal attention's. See docs/parallelism.md, "Context parallelism".
"""

from megalite.context_parallel.attention import COMM_TYPES, context_parallel_attention
from megalite.context_parallel.zigzag import zigzag_index, zigzag_split

__all__ = ["COMM_TYPES", "context_parallel_attention", "zigzag_index", "zigzag_split"]
