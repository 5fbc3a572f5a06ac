"""Run a schedule table on this rank: forward/backward of model chunks, activations and gradients
moved between pipeline ranks with tagged non-blocking sends and receives.

Sends never block (their buffers are kept until the step ends); a receive waits only for the one
tensor the next action needs, so a table that the simulator shows deadlock-free cannot hang here.
A stage's output keeps only its autograd graph after it is sent: its data is released, so 1F1B holds
at most p micro-batches of activations per stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from megalite import device as dev
from megalite.parallel.groups import ProcessGroups
from megalite.pipeline.schedule_table import Action

# forward_step(chunk_module, microbatch, hidden_or_None) -> loss (last stage) or hidden states
ForwardStep = Callable[[nn.Module, dict, torch.Tensor | None], torch.Tensor]


@dataclass
class PipelineRecord:
    """What one step did on this rank: seconds of forward and backward compute and of waiting for p2p
    receives; optionally the timeline of (kind, chunk, micro-batch, start, end) in wall-clock seconds
    (comparable across the ranks of a machine); and the peak number of live activations."""

    keep_timeline: bool = True
    synchronize: bool = False  # make device timings real (costs a sync per action)
    timeline: list[tuple[str, int, int, float, float]] = field(default_factory=list)
    peak_live: int = 0
    forward_s: float = 0.0
    backward_s: float = 0.0
    wait_s: float = 0.0


def _tag(kind: str, chunk: int, microbatch: int, vp: int) -> int:
    """Unique message tag: direction, receiving chunk, micro-batch."""
    return (microbatch * vp + chunk) * 2 + (0 if kind == "F" else 1)


def _backward(output: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Backward from an output whose data may have been released (only its graph is kept)."""
    if grad is None:
        output.backward()
        return
    torch.autograd.Variable._execution_engine.run_backward(  # skips the shape check of the freed data
        (output,), (grad,), False, False, (), True, True)


def _release(t: torch.Tensor) -> None:
    t.data = torch.empty((1,), dtype=t.dtype, device=t.device)


def run_table(table: Sequence[Action], chunks: Sequence[nn.Module], microbatches: Sequence[dict],
              forward_step: ForwardStep, pg: ProcessGroups, recv_shape: tuple[int, ...], dtype: torch.dtype,
              forward_only: bool = False, record: PipelineRecord | None = None, loss_scale: float = 1.0,
              last_backward: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """Execute this rank's ``table``; returns the (detached) losses of the last stage's micro-batches."""
    final_backward = {a.chunk: i for i, a in enumerate(table) if a.kind == "B"}
    p, r, vp = pg.pp_size, pg.pp_rank, len(chunks)
    m = len(microbatches)
    last_stage = p * vp - 1
    device = next(chunks[0].parameters()).device
    inputs: dict[tuple[int, int], torch.Tensor | None] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    sends: list[tuple[object, torch.Tensor]] = []
    losses: list[torch.Tensor] = []

    def recv(kind: str, chunk: int, mb: int, src: int) -> torch.Tensor:
        buf = torch.empty(recv_shape, dtype=dtype, device=device)
        t0 = time.time()
        pg.irecv(buf, src, _tag(kind, chunk, mb, vp)).wait()
        if record is not None:
            record.wait_s += time.time() - t0
        return buf

    def clock() -> float:
        if record is not None and record.synchronize:
            dev.synchronize()
        return time.time()

    def send(t: torch.Tensor, kind: str, chunk: int, mb: int, dst: int) -> None:
        t = t.detach().contiguous()
        sends.append((pg.isend(t, dst, _tag(kind, chunk, mb, vp)), t))

    for index, action in enumerate(table):
        c, mb = action.chunk, action.microbatch
        stage = c * p + r
        if action.kind == "F":
            hidden = None
            if stage > 0:  # from the previous virtual stage: rank r-1, or the last rank's previous chunk
                hidden = recv("F", c, mb, (r - 1) % p).requires_grad_(not forward_only)
            start = clock()  # compute starts once the input has arrived: waiting is bubble
            with torch.set_grad_enabled(not forward_only):
                out = forward_step(chunks[c], microbatches[mb], hidden)
            end = clock()  # compute only: the send and bookkeeping below are not busy time
            if stage == last_stage:
                losses.append(out.detach())
                out = out * (loss_scale / m)
            else:
                send(out, "F", c + (1 if r == p - 1 else 0), mb, (r + 1) % p)
            if not forward_only:
                inputs[(c, mb)] = hidden
                outputs[(c, mb)] = out
                if stage != last_stage:
                    _release(out)
            if record is not None:
                record.peak_live = max(record.peak_live, len(outputs))
        else:
            hidden, out = inputs.pop((c, mb)), outputs.pop((c, mb))
            grad = None if stage == last_stage else recv("B", c, mb, (r + 1) % p)
            start = clock()
            if last_backward is not None and final_backward[c] == index:
                last_backward(c)
            _backward(out, grad)
            end = clock()
            if stage > 0:
                send(hidden.grad, "B", c - (1 if r == 0 else 0), mb, (r - 1) % p)
        if record is not None:
            if action.kind == "F":
                record.forward_s += end - start
            else:
                record.backward_s += end - start
            if record.keep_timeline:
                record.timeline.append((action.kind, c, mb, start, end))
        sends = [(w, t) for w, t in sends if not w.is_completed()]
    for work, _ in sends:
        work.wait()
    return losses
