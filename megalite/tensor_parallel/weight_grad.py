"""The split backward of the zero-bubble schedules: B computes input gradients, W the weight gradients later.

A zero-bubble table runs each micro-batch's backward as two actions. B (on the critical path: the previous
stage waits for its input gradient) runs inside ``store.collect(key)``: every GEMM that supports it returns
its input gradient and queues, instead of computing, its weight gradient, keeping what that needs (its
output gradient and its input). W runs ``store.run(key)`` later, in what would be a bubble: each queued
weight gradient is computed and accumulated through autograd (``param.backward(grad)``), so the
gradient-accumulation hooks of bucketed DP, the distributed optimizer and ZeRO-2/3 fire exactly as in an
unsplit backward and see the same sums.

What is deferred: the weights of the tensor-parallel linear layers (column and row, with sequence
parallelism: the input's local shard is kept and all-gathered again in W, as the unsplit backward does),
the output layer (unfused; fused with the cross-entropy its GEMM runs in the forward by design, and only
its scaling and per-token corrections move to W), the routed experts and the word embedding (its dense
[v/tp, h] gradient, run last in its W, once the layers' W's have freed what they kept). What stays in B:
norms, biases, the learned positions, the router and the shared-expert gate (vectors or small GEMMs; their
gradients come with the input gradient's own kernels).

The output layer's W is queued apart and run as soon as its B's input gradient is on its way (the executor
calls ``store.run_prompt()`` right after posting B's send): it keeps a [s·b, v/tp] logits gradient (or the
fused path's fp32 [v/tp, h] partial gradient), which, left for the table's W, a zero-bubble schedule would
hold for up to p micro-batches on the loss rank, where 1F1B holds one. The stage before waits for B only, so
the critical path is unchanged; the loss rank runs the same work in the same steady-state order.

The deferrable path is taken only where a store is armed: in forwards run under ``store.deferrable()``
and in everything under ``collect`` (recomputation replays the forward there). Elsewhere the layers run
their usual kernels and nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from megalite.tensor_parallel.param_meta import param_meta

WeightGradFn = Callable[[], torch.Tensor]

_ARMED: WeightGradStore | None = None  # the store whose deferrable path is in use (forward or B)
_COLLECTING: tuple[WeightGradStore, Hashable] | None = None  # inside B: where W's go


class WeightGradStore:
    """The queued weight gradients of one pipeline pass, by (model chunk, micro-batch), run first in first
    out. Every tensor-parallel rank queues the same GEMMs in the same order, so a W that communicates (the
    sequence-parallel all-gather) pairs up across them."""

    def __init__(self) -> None:
        self._queues: dict[Hashable, list[tuple[nn.Parameter, WeightGradFn, tuple[torch.Tensor, ...]]]] = {}
        self._prompt: dict[Hashable, list[tuple[nn.Parameter, WeightGradFn, tuple[torch.Tensor, ...]]]] = {}
        self.deferred: dict[int, set[nn.Parameter]] = {}  # chunk -> parameters whose gradient W computes

    @contextmanager
    def deferrable(self) -> Iterator[None]:
        """Forwards under this build the graph whose backward can defer its weight gradients."""
        global _ARMED
        before, _ARMED = _ARMED, self
        try:
            yield
        finally:
            _ARMED = before

    @contextmanager
    def collect(self, key: Hashable) -> Iterator[None]:
        """A backward under this queues its deferrable weight gradients under ``key`` ((chunk, micro-batch))."""
        global _ARMED, _COLLECTING
        before = _ARMED, _COLLECTING
        _ARMED, _COLLECTING = self, (self, key)
        self._queues.setdefault(key, [])
        try:
            yield
        finally:
            _ARMED, _COLLECTING = before

    def defer(self, key: Hashable, param: nn.Parameter, fn: WeightGradFn, kept: tuple[torch.Tensor, ...],
              prompt: bool | None = None) -> None:
        """Queue ``param``'s weight gradient for the W of ``key``; the output layer's (``prompt``; None: a
        vocabulary-sized weight, ``ParamMeta.embedding_or_output``, that is not the embedding's lookup) for
        ``run_prompt`` instead, right after this B. That one is not counted in ``deferred``: its gradient is
        complete before any W of the chunk runs."""
        if param_meta(param).embedding_or_output if prompt is None else prompt:
            self._prompt.setdefault(key, []).append((param, fn, kept))
            return
        self._queues[key].append((param, fn, kept))
        if isinstance(key, tuple) and key:
            self.deferred.setdefault(key[0], set()).add(param)

    def run(self, key: Hashable) -> None:
        """W of ``key``: compute its queued weight gradients and accumulate them (hooks fire), in B's order (the
        embedding's last, once the layers' kept tensors are freed); the output layer's first if ``run_prompt``
        has not run them."""
        _accumulate(self._prompt.pop(key, []) + self._queues.pop(key, []))

    def run_prompt(self) -> None:
        """The output layer's weight gradients the B's so far queued: run once B's input gradient is sent."""
        for key in list(self._prompt):
            _accumulate(self._prompt.pop(key))

    def queued(self) -> set[nn.Parameter]:
        """The parameters with a weight gradient still queued."""
        return {p for q in [*self._queues.values(), *self._prompt.values()] for p, _, _ in q}

    def pending(self) -> int:
        """W's queued and not yet run (micro-batches of model chunks)."""
        return sum(1 for q in self._queues.values() if q)

    def pending_bytes(self) -> int:
        """Bytes kept for the queued weight gradients (output gradients and inputs), each tensor once."""
        seen = {(t.data_ptr(), t.numel() * t.element_size()) for q in [*self._queues.values(),
                                                                          *self._prompt.values()]
                for _, _, kept in q for t in kept}
        return sum(n for _, n in seen)


def _accumulate(queue: list[tuple[nn.Parameter, WeightGradFn, tuple[torch.Tensor, ...]]]) -> None:
    """Compute each queued weight gradient and accumulate it through autograd (its hooks fire). Each entry is
    dropped before the next runs, so what it kept is freed as W goes (not at its end)."""
    queue.reverse()
    while queue:
        param, fn, _ = queue.pop()
        with torch.no_grad():  # as inside a backward: W records no graph
            grad = fn()
        del fn, _
        torch.autograd.backward([param], [grad.to(param.dtype)])
        del grad


def armed() -> bool:
    """Whether GEMMs should build the deferrable graph."""
    return _ARMED is not None


def weight_grad(param: nn.Parameter, fn: WeightGradFn, *kept: torch.Tensor, prompt: bool | None = None
                ) -> torch.Tensor | None:
    """In an autograd backward: ``param``'s gradient now (returned), or, inside B, queued for W (None is
    returned, so autograd accumulates nothing now). ``kept``: what ``fn`` holds, for the byte count;
    ``prompt``: see ``WeightGradStore.defer``."""
    if _COLLECTING is None or not param.requires_grad:
        return fn() if param.requires_grad else None
    store, key = _COLLECTING
    store.defer(key, param, fn, kept, prompt)
    return None


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _DeferrableLinear(torch.autograd.Function):
    """y = x W^T + b whose weight gradient may move to W (the bias's stays in B)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: nn.Parameter, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = g.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = weight_grad(weight, lambda: _flat(g).t().matmul(_flat(x)), g, x)
        grad_b = _flat(g).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: nn.Parameter, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, deferrable where a store is armed."""
    if armed() and weight.requires_grad and torch.is_grad_enabled():
        return _DeferrableLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class _DeferrableEmbedding(torch.autograd.Function):
    """F.embedding whose weight gradient may move to W: a dense [rows, h] gradient that, made in B, would be
    live beside every tensor the layers keep for their W's (the stage's peak at a large vocabulary); W
    makes it last, after the layers' have run and freed theirs. Same kernel as autograd's."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: nn.Parameter) -> torch.Tensor:
        ctx.save_for_backward(ids, weight)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        ids, weight = ctx.saved_tensors
        rows = weight.shape[0]
        return None, weight_grad(weight, lambda: torch.ops.aten.embedding_dense_backward(g, ids, rows, -1, False),
                                 g, ids, prompt=False)


def embedding(ids: torch.Tensor, weight: nn.Parameter) -> torch.Tensor:
    """F.embedding, its weight gradient deferrable where a store is armed."""
    if armed() and weight.requires_grad and torch.is_grad_enabled():
        return _DeferrableEmbedding.apply(ids, weight)
    return F.embedding(ids, weight)


GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _DeferrableExperts(torch.autograd.Function):
    """The local experts' GEMMs over consecutive row blocks (x [n, in], weight [E, out, in]), the stacked
    weight's gradient deferrable as one W. With ``grouped`` (a grouped GEMM, ``mm(x, w_t, offs)``) F and B's
    input gradient stay one grouped GEMM each; only W, off the critical path, loops over the experts."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: nn.Parameter, counts: list[int], grouped: GroupedMM | None):
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.grouped = counts, grouped
        if grouped is not None:
            return grouped(x, weight.transpose(1, 2), _offsets(counts, x.device))
        return torch.cat([p @ weight[e].t() for e, p in enumerate(x.split(counts))])

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        counts = ctx.counts
        g = g.contiguous()
        if ctx.grouped is not None:
            grad_x = ctx.grouped(g, weight, _offsets(counts, g.device))
        else:
            grad_x = torch.cat([q @ weight[e] for e, q in enumerate(g.split(counts))])

        def grad_w() -> torch.Tensor:
            return torch.stack([q.t() @ p for q, p in zip(g.split(counts), x.split(counts), strict=True)])

        return grad_x, weight_grad(weight, grad_w, g, x), None, None


def _offsets(counts: list[int], device: torch.device) -> torch.Tensor:
    """The grouped GEMM's group ends."""
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


def experts_linear(x: torch.Tensor, weight: nn.Parameter, counts: list[int],
                   grouped: GroupedMM | None = None) -> torch.Tensor | None:
    """The experts' GEMMs on the deferrable path (F and B's input gradient through ``grouped`` where
    given), or None where no store is armed (the caller's kernels)."""
    if armed() and weight.requires_grad and torch.is_grad_enabled() and x.shape[0] > 0:
        return _DeferrableExperts.apply(x, weight, list(counts), grouped)
    return None
