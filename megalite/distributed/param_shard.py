"""Sharded parameters (ZeRO-3, ``--data-parallel-sharding-strategy optim_grads_params``): each unit's
weights are all-gathered over DP just before they are used and freed right after.

A model chunk is cut into units: the chunk's own parameters (embedding, final norm, output layer; held
for the whole forward and the whole backward, since the head's backward comes first and the embedding's
last) and one unit per transformer layer. Each unit is a bucket of its own in the chunk's GradBuffer,
which keeps this rank's shard of it in ``param_shard``; while not gathered a parameter holds a NaN
placeholder of its shape until its unit is first gathered (see ``grad_buffer.placeholder``); from then on it
is a view of the unit's full buffer, whose storage is freed (resized to nothing) when the unit is released
and re-allocated by the next gather, so that tensors autograd saved from it hold no memory in between and
read the gathered weights again in the unit's backward; touching a released parameter raises.

Forward: a module's pre-hook gathers its unit (normally already in flight) and starts gathering the
next layer's, so the gather overlaps the current layer's compute; its post-hook frees the unit.
Backward: a hook on the unit's output fires when that output's gradient arrives, just before the unit's
backward; it gathers the unit (prefetched by the later layer) and starts the previous layer's. The unit
is freed once its gradients are reduce-scattered (``GradBuffer.on_reduced``). So every micro-batch
all-gathers the parameters twice, once for forward and once for backward.

``keep`` (``--fsdp-keep-params-across-microbatches``): nothing is freed until the step's gradients are
final; one all-gather per unit and step, at the price of holding the chunk's full weights for the
whole step (what pipeline schedules with many micro-batches want). A forward run inside backward
(activation recomputation) gathers what it needs and neither prefetches nor frees: the unit's reduced
gradients free it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

import torch
from torch import nn

from megalite import compat
from megalite.distributed.grad_buffer import GradBuffer
from megalite.parallel.groups import ProcessGroups


def param_units(chunk: nn.Module) -> list[list[nn.Parameter]]:
    """The chunk's own parameters, then each transformer layer's, in forward order."""
    layers = list(chunk.layers.values()) if hasattr(chunk, "layers") else []
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    own = [p for p in chunk.parameters() if id(p) not in in_layers]
    return [own, *[list(layer.parameters()) for layer in layers]]


class ParamGatherer:
    """Gathers and frees the units of one chunk (module hooks); the chunk's modules know nothing of it."""

    def __init__(self, chunk: nn.Module, buffer: GradBuffer, pg: ProcessGroups, keep: bool = False) -> None:
        self.buffer, self.pg, self.keep = buffer, pg, keep
        self.units = buffer.unit_buckets
        self.full: list[list[torch.Tensor] | None] = [None] * len(self.units)  # gathered now
        self.storage: list[list[torch.Tensor] | None] = [None] * len(self.units)  # each bucket's full buffer
        self.works: list[list] = [[] for _ in self.units]
        self.reduced = [0] * len(self.units)
        self.unit_of = {id(b): i for i, unit in enumerate(self.units) for b in unit}
        modules = [chunk, *(chunk.layers.values() if hasattr(chunk, "layers") else [])]
        assert len(modules) == len(self.units), "units and modules out of step"
        for i, m in enumerate(modules):
            m.register_forward_pre_hook(partial(self._pre_forward, i))
            m.register_forward_hook(partial(self._post_forward, i))
        buffer.on_reduced = self._reduced
        buffer.param_gatherer = self

    # ---- gather / free -----------------------------------------------------------------------
    def gather(self, i: int) -> None:
        """Start all-gathering unit ``i`` (a no-op when it is gathered or on its way)."""
        if i >= len(self.units) or self.full[i] is not None:
            return
        buf, first = self.buffer, self.storage[i] is None
        if first:  # one full buffer per bucket for the run; the parameters stay views of it
            self.storage[i] = [torch.empty(b.numel, dtype=buf.param_shard.dtype, device=buf.param_shard.device)
                               for b in self.units[i]]
        for b, full in zip(self.units[i], self.storage[i]):
            full.untyped_storage().resize_(full.numel() * full.element_size())  # re-allocate after a release
            lo = buf.shard_offset(b)
            shard = buf.param_shard[lo: lo + b.numel // buf.dp]
            self.works[i].append(self.pg.all_gather_flat(full, shard, buf.kind, async_op=True,
                                                         label="param_all_gather"))
            for p in b.params if first else []:
                s, e = buf.ranges[p]
                p.data = full[s - b.start: e - b.start].view(p.shape)
        self.full[i] = self.storage[i]

    def wait(self, i: int) -> None:
        for w in self.works[i]:
            if w is not None:
                w.wait()
        self.works[i] = []

    def release(self, i: int) -> None:
        """Free unit ``i``'s full weights (after its gather finished)."""
        if self.full[i] is None:
            return
        self.wait(i)
        for full in self.full[i]:
            # Free the memory itself, not only the parameters' reference: autograd saved views of these
            # weights (a linear layer's transposed weight) until the unit's backward, which gathers into
            # the same storage again before it reads them.
            full.untyped_storage().resize_(0)
        self.full[i] = None

    def release_all(self) -> None:
        for i in range(len(self.units)):
            self.release(i)
        self.reduced = [0] * len(self.units)

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy this rank's shard of the gathered weights into the shard storage (after a load)."""
        buf = self.buffer
        for i, unit in enumerate(self.units):
            for b, full in zip(unit, self.full[i] or []):
                lo, hi = buf.shard_range(b)
                off = buf.shard_offset(b)
                buf.param_shard[off: off + hi - lo].copy_(full[lo - b.start: hi - b.start])

    # ---- hooks -------------------------------------------------------------------------------
    def _pre_forward(self, i: int, module: nn.Module, args) -> None:
        self.gather(i)
        self.wait(i)
        if not compat.in_backward():  # prefetch the next layer (the chunk's own unit, 0, encloses them all)
            self.gather(i + 1)

    def _post_forward(self, i: int, module: nn.Module, args, out) -> None:
        training = torch.is_grad_enabled()
        if training and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad, i=i: self._pre_backward(i))
        if not compat.in_backward() and not (self.keep and module.training):
            self.release(i)

    def _pre_backward(self, i: int) -> None:
        self.gather(i)
        self.wait(i)
        previous = len(self.units) - 1 if i == 0 else i - 1  # the chunk's own unit is still gathered
        if previous > 0:
            self.gather(previous)

    def _reduced(self, bucket) -> None:
        i = self.unit_of[id(bucket)]
        self.reduced[i] += 1
        if self.reduced[i] == len(self.units[i]):
            self.reduced[i] = 0
            if not self.keep:
                self.release(i)


@contextlib.contextmanager
def full_params(buffers: list[GradBuffer], write_back: bool = False) -> Iterator[None]:
    """Every parameter gathered in full for the block (a save reads them, a load writes them; with
    ``write_back`` the loaded weights become this rank's shards). A no-op without sharded parameters."""
    gatherers = [b.param_gatherer for b in buffers if getattr(b, "param_gatherer", None) is not None]
    for g in gatherers:
        for i in range(len(g.units)):
            g.gather(i)
            g.wait(i)
    try:
        yield
        if write_back:
            for g in gatherers:
                g.write_back()
    finally:
        for g in gatherers:
            g.release_all()
