"""A torch_dist checkpoint's dp_reshardable buckets laid out in another parameter order, at the reader's
interface (keys, shapes, tensors, byte items), for the orders megatron-core cannot build on CPU here:
Transformer Engine's spec and its grouped experts need Transformer Engine. The source is a real save of the
local spec; each parameter's slice of every field is moved from megatron-core's local layout to where the
other order puts it (its buffer walked in reverse, each start rounded up to 64 elements, one bucket), and the
saved bucket sizes follow. Only single-bucket buffers (no overlapped reduction) are re-laid.

``Relaid`` re-lays the one dense buffer of a run without experts or pipeline stages; ``RelaidBuffers`` every
buffer the reader places (chained ``chained_<i>.`` optimizers, every dp group, every model chunk), each
buffer's own parameters put in the new order by a sort key."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from megalite.checkpointing.megatron.buffer import align
from megalite.checkpointing.megatron.names import split_optimizer_keys
from megalite.checkpointing.megatron.torch_dist import dp_optim as dpo


class _Relaid:
    """The source with some bucket tensors replaced and their saved sizes rewritten."""

    def __init__(self, src: Any) -> None:
        self.src = src
        self.tensors: dict[str, torch.Tensor] = {}
        self.sizes: dict[str, dict[int, list[int]]] = {}  # per_bucket_numel_unpadded key -> gbuf -> bucket sizes

    def keys(self) -> list[str]:
        return self.src.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape) if key in self.tensors else self.src.shape(key)

    def tensor(self, key: str) -> torch.Tensor:
        return self.tensors[key] if key in self.tensors else self.src.tensor(key)

    def object(self, key: str) -> Any:
        obj = self.src.object(key)
        if key not in self.sizes:
            return obj
        new = self.sizes[key]

        def swap(x: Any) -> Any:  # the saved list of one {dtypes: bucket sizes} per buffer, in wrapping lists
            if isinstance(x, list) and x and all(isinstance(d, dict) for d in x):
                return [{k: list(new.get(b, v)) for k, v in d.items()} for b, d in enumerate(x)]
            return [swap(v) for v in x] if isinstance(x, list) else x
        return swap(copy.deepcopy(obj))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.src, name)


class Relaid(_Relaid):
    def __init__(self, src: Any, order: Callable[[list], list]) -> None:
        super().__init__(src)
        keys = split_optimizer_keys(src.keys())[0]
        tp = int(src.common["args"].tensor_model_parallel_size)
        local = dpo._ordered(src, keys)
        for g, buffers in dpo._buckets(src.keys())[""].items():
            (size,) = dpo._group_sizes(src, "", g, buffers)[0]
            old = dpo._place(local, tp, [size])
            new_order = order(local)
            total = 0
            for _, shape, dim in reversed(new_order):
                local_shape = [s // tp if i == dim else s for i, s in enumerate(shape)]
                total = align(total) + int(torch.Size(local_shape).numel())
            new = dpo._place(new_order, tp, [total])
            for field_keys in buffers[0].values():
                flat = src.tensor(field_keys[0])
                out = torch.zeros(total, dtype=flat.dtype)
                for name, (_, start, shape) in old.items():
                    n, at = int(torch.Size(shape).numel()), new[name][1]
                    out[at:at + n] = flat[start:start + n]
                self.tensors[field_keys[0]] = out
            self.sizes[f"optimizer.distributed.dp_group_idx_{g}.per_bucket_numel_unpadded"] = {0: [total]}


class RelaidBuffers(_Relaid):
    """Every buffer the reader places for ``args`` (the save's own: megatron-core's local layout), its
    parameters re-laid in the order of ``key(name)`` (their registration order in the other spec)."""

    def __init__(self, src: Any, args: Any, key: Callable[[str], Any]) -> None:
        super().__init__(src)
        got = dpo.dp_reshardable_jobs(src, split_optimizer_keys(src.keys())[0], args)
        assert not isinstance(got, str), got
        jobs, groups, _ = got
        for prefix, g, c, _, _, placed in jobs:
            assert {b for b, _, _ in placed.values()} == {0}, "one bucket per buffer is re-laid"
            new, total = {}, 0
            for name in sorted(placed, key=key, reverse=True):  # the buffer holds the registration order reversed
                total = align(total)
                new[name], total = total, total + int(torch.Size(placed[name][2]).numel())
            for buckets in groups[prefix][g][c].values():  # each field's one bucket
                flat = self.src.tensor(buckets[0])
                out = torch.zeros(total, dtype=flat.dtype)
                for name, (_, start, shape) in placed.items():
                    n = int(torch.Size(shape).numel())
                    out[new[name]:new[name] + n] = flat[start:start + n]
                self.tensors[buckets[0]] = out
            where = f"{prefix}optimizer.distributed.dp_group_idx_{g}.per_bucket_numel_unpadded"
            self.sizes.setdefault(where, {})[c] = [total]
