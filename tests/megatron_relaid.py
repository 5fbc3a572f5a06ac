"""A torch_dist checkpoint's dp_reshardable buckets laid out in another parameter order, at the reader's
interface (keys, shapes, tensors, byte items), for the orders megatron-core cannot build on CPU here:
Transformer Engine's spec needs Transformer Engine. The source is a real save of the local spec; each
parameter's slice of every field is moved from megatron-core's local layout to where the other order puts
it (its buffer walked in reverse, each start rounded up to 64 elements, one bucket), and the saved bucket
sizes follow. Only single-bucket buffers (no overlapped reduction) are re-laid."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from megalite.checkpointing import megatron_dp_optim as dpo
from megalite.checkpointing.megatron_buffer import align
from megalite.checkpointing.megatron_names import split_optimizer_keys


class Relaid:
    def __init__(self, src: Any, order: Callable[[list], list]) -> None:
        self.src, self.tensors, self.sizes = src, {}, {}
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
            self.sizes[f"optimizer.distributed.dp_group_idx_{g}.per_bucket_numel_unpadded"] = (size, total)

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
        old, new = self.sizes[key]

        def swap(x: Any) -> Any:
            if isinstance(x, list | tuple) and list(x) == [old]:
                return [new]
            if isinstance(x, dict):
                return {k: swap(v) for k, v in x.items()}
            return [swap(v) for v in x] if isinstance(x, list) else x
        return swap(copy.deepcopy(obj))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.src, name)
