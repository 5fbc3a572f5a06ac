"""Activation recomputation: keep only a region's inputs in forward, run it again in backward.

The RNG states (host, device and the model-parallel tracker) are captured before the forward and
restored for the recomputation, so dropout draws the same masks both times; the states in use are put
back afterwards, so recomputation never shifts the random stream of the rest of the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megalite import compat, device
from megalite.tensor_parallel.random import RNGTracker


def _capture(tracker: RNGTracker) -> tuple:
    return torch.get_rng_state(), device.get_rng_state(), tracker.get_states()


def _restore(tracker: RNGTracker, states: tuple) -> None:
    cpu, dev, tracked = states
    torch.set_rng_state(cpu)
    device.set_rng_state(dev)
    tracker.set_states(tracked)


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable, tracker: RNGTracker, *args: Any):
        ctx.fn, ctx.tracker = fn, tracker
        ctx.rng = _capture(tracker)
        ctx.tensor_index = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.args = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_index))
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.args)
        inputs = []
        for i, t in zip(ctx.tensor_index, ctx.saved_tensors):
            t = t.detach().requires_grad_(t.is_floating_point())
            args[i] = t
            inputs.append(t)
        now = _capture(ctx.tracker)
        _restore(ctx.tracker, ctx.rng)
        try:
            with torch.enable_grad(), compat.recomputing():
                out = ctx.fn(*args)
        finally:
            _restore(ctx.tracker, now)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        arg_grads = [None] * len(args)
        for i, t in zip(ctx.tensor_index, inputs):
            arg_grads[i] = t.grad
        return (None, None, *arg_grads)


def recompute(fn: Callable, tracker: RNGTracker, *args: Any) -> Any:
    """``fn(*args)`` whose activations are recomputed in backward instead of stored."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return _Recompute.apply(fn, tracker, *args)
