"""Where megatron-core's distributed optimizer keeps each parameter's state: its gradient buffer's layout.

megatron-core's DistributedDataParallel lays a model chunk's parameters into one flat buffer in reverse of
their registration order (roughly the order of backprop), each start rounded up to 64 elements, and cuts
the buffer into buckets: a bucket is closed once it holds ``bucket_size`` elements or more, and a
pipeline stage's shared (tied) embedding gets a bucket of its own. The distributed optimizer saves its
state bucket by bucket in that layout, each bucket at its unpadded size (the padding that evens the
buckets out over the DP ranks dropped). Both of its layouts megalite reads rebuild it here: the
torch_dist ``dp_reshardable`` buckets (torch_dist/dp_optim.py, whose sizes are saved) and the legacy
``distrib_optim.pt`` (legacy/distrib_optim.py, where only their total is and the sizes follow the rule).
"""

from __future__ import annotations

from typing import Any

import torch

ALIGN = 64  # megatron-core pads each parameter's start in a distributed-optimizer buffer to 64 elements
Placed = dict[str, tuple[int, int, tuple[int, ...]]]  # name -> (bucket, start in it, shape)
FIELDS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "param": "main"}  # saved field -> megalite's
# megatron-core's two distributed optimizers of an MoE run, named by what tells them apart in a checkpoint:
# the param groups' ``is_expert_parallel`` (a file-format label, not one of megalite's parameter families)
DENSE_OPTIMIZER, EP_OPTIMIZER = "dense", "expert_parallel"


def optimizer_kind(param_groups: Any, position: int) -> str | None:
    """DENSE_OPTIMIZER or EP_OPTIMIZER for one of a ChainedOptimizer's saved optimizers, by its param groups'
    ``is_expert_parallel`` (megatron-core saves it; where a group lacks it, the chained position: the dense
    optimizer first); None when its groups are missing or mixed. The one rule both readers use."""
    flags = {bool(g.get("is_expert_parallel", position > 0)) for g in param_groups or [] if isinstance(g, dict)}
    return (EP_OPTIMIZER if flags.pop() else DENSE_OPTIMIZER) if len(flags) == 1 else None


def align(n: int) -> int:
    """A parameter's start in its bucket: the next multiple of ALIGN elements."""
    return -(-n // ALIGN) * ALIGN


def place_buffer(shapes: list[tuple[str, tuple[int, ...]]], sizes: list[int]) -> Placed | str:
    """Per parameter (bucket, start in it, shape), ``shapes`` in buffer order (the reverse of megatron-core's
    parameter order), each start rounded up to ALIGN, a bucket ending where its size ends (or at the next
    aligned start: megatron-core closes a bucket there before a pipeline stage's shared embedding); every
    bucket must be filled exactly, or why not is returned."""
    out, bucket, cursor = {}, 0, 0
    for name, shape in shapes:
        if cursor and bucket < len(sizes) and align(cursor) == sizes[bucket]:
            bucket, cursor = bucket + 1, 0
        start = align(cursor)
        end = start + int(torch.Size(shape).numel())
        if bucket >= len(sizes) or end > sizes[bucket]:
            return f"{name} does not fit in bucket {bucket} of sizes {sizes} (megatron-core's layout not matched)"
        out[name] = (bucket, start, shape)
        bucket, cursor = (bucket + 1, 0) if end == sizes[bucket] else (bucket, end)
    if bucket != len(sizes):
        return f"the parameters fill {bucket} of its {len(sizes)} buckets {sizes}, not all"
    return out


def bucket_sizes(numels: list[tuple[str, int]], bucket_size: int | None, alone: set[str]) -> list[int]:
    """The unpadded bucket sizes megatron-core gives parameters of ``numels`` (name, elements; buffer
    order): a bucket closes once it reaches ``bucket_size`` (None: one bucket), and each parameter of
    ``alone`` (a pipeline stage's shared embedding) closes the bucket before it, at its aligned start, and
    its own."""
    sizes, cursor, held = [], 0, 0
    for name, n in numels:
        start = align(cursor)
        if name in alone and held:
            sizes.append(start)
            start, held = 0, 0
        end, held = start + n, held + 1
        if (bucket_size is not None and end >= bucket_size) or name in alone:
            sizes.append(end)
            cursor, held = 0, 0
        else:
            cursor = end
    if held:
        sizes.append(cursor)
    return sizes


def group_steps(saved: Any) -> set[float]:
    """The step counts of a distributed optimizer's saved ``param_groups`` (its ``state_dict()`` without the
    parameter state; -1 for a group without a number there: never a traceback on a malformed file)."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    out = set()
    for p in groups or []:
        step = p.get("step", -1) if isinstance(p, dict) else -1
        ok = isinstance(step, int | float) or (isinstance(step, torch.Tensor) and step.numel() == 1)
        out.add(float(step) if ok else -1.0)
    return out


def main_mismatch(main: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> str | None:
    """The first weight whose fp32 main parameter is missing or is not it (cast to the weight's dtype:
    megatron-core copies the one into the other after each step), or None: the check that a buffer was cut
    by megatron-core's parameter order, so a state laid out another way is refused, never read wrong."""
    for name, weight in weights.items():
        got = main.get(name)
        if got is None:
            return f"no fp32 parameter of {name}"
        if got.shape != weight.shape or not torch.equal(got.to(weight.dtype), weight):
            return f"its fp32 parameter of {name} is not the saved weight"
    return None
