"""What a run holds, counted from its tensors' storages: shared by the tests and the benches that read
memory off a real run (bench/bench_data_parallel.py, bench/bench_sharding.py, bench/bench_pipeline.py).

- ``storage_by_kind``: the bytes of distinct storages a rank keeps for parameters, gradients, fp32 main
  parameters and Adam moments after ``pretrain()`` (a flat buffer counts once, padding included).
- ``SavedTensor`` / ``peak_saved_bytes``: autograd's saved-tensor hooks log every storage saved for
  backward and its release; the peak over time of the distinct storages live (parameters excluded).
"""

from __future__ import annotations

import torch

from megalite.training.loop import TrainResult


def _nbytes(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def storage_by_kind(res: TrainResult) -> dict[str, float]:
    """Bytes of distinct storages this rank holds for params, grads, main params, Adam moments."""
    opt = res.optimizer
    params = {p for c in res.chunks for p in c.parameters()}
    seen: set[int] = set()

    def total(tensors) -> int:
        n = 0
        for t in tensors:
            key, size = _nbytes(t)
            if key not in seen:
                seen.add(key)
                n += size
        return n

    out = {"params": total(p.data for p in params)}
    out["grads"] = total([b.grad_data for b in opt.buffers] + [p.grad for p in params if p.grad is not None])
    out["main params"] = total(e.main for e in opt.entries if not e.alias)
    states = list(opt.adam.state.values())
    out["adam moments"] = total([s["exp_avg"] for s in states] + [s["exp_avg_sq"] for s in states])
    out["numel"] = sum(p.numel() for p in params)
    out["adam states"] = len(states)
    return out


class SavedTensor:
    """What the autograd graph holds for one saved tensor; logs its storage when packed and freed
    (``torch.autograd.graph.saved_tensors_hooks(lambda t: SavedTensor(t, log), lambda s: s.tensor)``)."""

    __slots__ = ("tensor", "key", "log")

    def __init__(self, tensor: torch.Tensor, log: list) -> None:
        storage = tensor.untyped_storage()
        self.tensor, self.key, self.log = tensor, storage.data_ptr(), log
        log.append((1, self.key, storage.nbytes()))

    def __del__(self) -> None:
        self.log.append((-1, self.key, 0))


def peak_saved_bytes(log: list, exclude: set[int]) -> int:
    """Peak over time of the bytes of distinct storages saved for backward (parameters excluded)."""
    count: dict[int, int] = {}
    size: dict[int, int] = {}
    live = peak = 0
    for sign, key, nbytes in log:
        if key in exclude:
            continue
        if sign > 0:
            size.setdefault(key, nbytes)
            count[key] = count.get(key, 0) + 1
            if count[key] == 1:
                live += size[key]
        else:
            count[key] -= 1
            if count[key] == 0:
                live -= size.pop(key)
                del count[key]
        peak = max(peak, live)
    return peak
