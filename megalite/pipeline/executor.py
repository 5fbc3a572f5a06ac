"""Run a schedule table on this rank: forward/backward of model chunks, activations and gradients moved
between pipeline ranks in batches that are safe under NCCL (megalite/pipeline/p2p_plan.py).

After each round of the plan the rank posts one batch: the send of what its action produced and the
receives of what its neighbours produced in that round. It waits for a batch only when an action needs a
tensor it receives (NCCL completes a batch as one); other batches stay in flight, their buffers kept
until they complete, and all are waited on before the pass ends (``ProcessGroups.end_step``). No message
depends on a tag. A stage's output keeps only its autograd graph after it is handed to the send: its data
is released, so 1F1B holds at most p micro-batches of activations. Where the V shape turns (ZB-V, rank p-1's
chunk 0 feeds its own chunk 1) the hand-off stays on the rank, no message.

Tables with W actions (the zero-bubble schedules) split each backward: B runs inside
``weight_grads.collect((chunk, micro-batch))``, so the layers that support it compute only their input
gradient and queue their weight gradients, and W runs ``weight_grads.run((chunk, micro-batch))``
(``tensor_parallel/weight_grad.py``). The output layer's weight gradient is the exception: it runs right
after its B's batch is posted (``store.run_prompt()``), so the loss rank holds one micro-batch's logits
gradient at a time, as 1F1B does, and the stage before it still gets its input gradient at the end of B
(the timeline counts that work in B). Without a store, B is the whole backward and W does nothing (the same
gradients, the same messages).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from megalite.parallel.groups import P2POp, P2PWork, ProcessGroups
from megalite.parallel.loss_scaling import LossScaling
from megalite.pipeline.p2p_plan import Message, Step, needed, produced, round_plan
from megalite.pipeline.schedule_table import Action
from megalite.pipeline.stages import StageMap
from megalite.tensor_parallel.weight_grad import WeightGradStore

# forward_step(chunk_module, microbatch, hidden_or_None) -> loss (last stage) or hidden states
ForwardStep = Callable[[nn.Module, dict, torch.Tensor | None], torch.Tensor]


@dataclass
class PipelineRecord:
    """What one step did on this rank: seconds of forward and backward compute and of waiting for p2p
    receives; optionally the timeline of (kind, chunk, micro-batch, start, end) in wall-clock seconds
    (comparable across the ranks of a machine); the peak number of live activations and, in a split backward,
    of queued weight gradients and their bytes."""

    keep_timeline: bool = True
    synchronize: bool = False  # make device timings real (costs a sync per action)
    timeline: list[tuple[str, int, int, float, float]] = field(default_factory=list)
    peak_live: int = 0
    peak_deferred: int = 0  # split backward: most W's pending at once (chunk micro-batches)
    peak_deferred_bytes: int = 0  # and the bytes they kept (output gradients, inputs)
    forward_s: float = 0.0
    backward_s: float = 0.0
    wait_s: float = 0.0


def _backward(output: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Backward from an output whose data may have been released (only its graph is kept)."""
    if grad is None:
        output.backward()
        return
    torch.autograd.Variable._execution_engine.run_backward(  # skips the shape check of the freed data
        (output,), (grad,), False, False, (), True, True)


def _release(t: torch.Tensor) -> None:
    t.data = torch.empty((1,), dtype=t.dtype, device=t.device)


@dataclass
class PipelinePass:
    """One pass of a rank's model chunks over a step's micro-batches: what forward_backward and run_table
    execute. ``forward_step`` gives a micro-batch's output on each stage (the last stage's is this rank's
    share of the loss in training), ``recv_shape`` the hidden states passed between stages (their dtype is
    the chunks' parameters'). ``scaling`` turns the last stage's output into the micro-batch loss and its
    backward seed (docs/design.md §3.9); without one, the loss is the output and the seed output / m.
    ``last_backward(chunk, deferred)`` runs just before each chunk's last backward (``deferred`` None), or
    its last W where the table has W's (``deferred``: the parameters whose gradients W's still add; every
    other parameter's are complete): its buckets may start reducing. ``weight_grads``: the split
    backward's ``WeightGradStore`` (see the module docstring); ``stages``: the placement of the chunks
    (default round-robin); ``holds``: per rank, the most chunk-micro-batches a zero-bubble table keeps between
    F and W (``ScheduleSpec.holds``; every rank must be given the same)."""

    chunks: Sequence[nn.Module]
    microbatches: Sequence[dict]
    forward_step: ForwardStep
    pg: ProcessGroups
    recv_shape: tuple[int, ...]
    forward_only: bool = False
    record: PipelineRecord | None = None
    scaling: LossScaling | None = None
    last_backward: Callable[[int, set | None], None] | None = None
    weight_grads: WeightGradStore | None = None
    stages: StageMap | None = None
    holds: tuple[int, ...] | None = None  # zero bubble: ScheduleSpec.holds (None: the schedule's own)


@dataclass
class _Run:
    """The state of one rank's pass over its table."""

    job: PipelinePass
    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    outbox: list[torch.Tensor] = field(default_factory=list)  # what this round's action produced
    received: dict[Message, tuple[torch.Tensor, P2PWork]] = field(default_factory=dict)
    in_flight: list[P2PWork] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    local: dict[Message, torch.Tensor] = field(default_factory=dict)  # hand-offs between this rank's chunks
    split: bool = False  # the table has W's: each B computes input gradients only

    def __post_init__(self) -> None:
        j = self.job
        self.chunks, self.microbatches, self.pg, self.record = j.chunks, j.microbatches, j.pg, j.record
        self.forward_only = j.forward_only
        self.scaling = j.scaling or LossScaling(len(j.microbatches))
        self.p, self.r, self.vp = self.pg.pp_size, self.pg.pp_rank, len(self.chunks)
        self.stages = j.stages or StageMap(self.p, self.vp)
        self.last_stage = self.stages.last
        first = next(self.chunks[0].parameters())
        self.device, self.dtype = first.device, first.dtype

    def clock(self) -> float:
        if self.record is not None and self.record.synchronize:
            self.pg.host_sync("pipeline timeline")
        return time.time()

    def exchange(self, step: Step) -> None:
        """Post this round's batch: the action's output, and receives for what the neighbours produced."""
        ops = [P2POp("send", t, peer, msg.label()) for (peer, msg), t in zip(step.sends, self.outbox, strict=True)]
        self.outbox = []
        bufs = {}
        for peer, msg in step.recvs:
            bufs[msg] = torch.empty(self.job.recv_shape, dtype=self.dtype, device=self.device)
            ops.append(P2POp("recv", bufs[msg], peer, msg.label()))
        if not ops:
            return
        work = self.pg.post_p2p(ops, f"round {step.round}")
        self.in_flight = [w for w in self.in_flight if not w.is_completed()] + [work]
        for msg, buf in bufs.items():
            self.received[msg] = (buf, work)

    def take(self, action: Action) -> torch.Tensor | None:
        """The tensor ``action`` needs, waiting for its batch if it has not completed yet."""
        need = needed(action, self.p, self.r, self.vp, self.stages)
        if need is None:
            return None
        if need[0] == self.r:
            return self.local.pop(need[1])
        buf, work = self.received.pop(need[1])
        t0 = time.time()
        work.wait()
        if self.record is not None:
            self.record.wait_s += time.time() - t0
        return buf

    def forward(self, action: Action, hidden: torch.Tensor | None) -> tuple[float, float]:
        c, mb = action.chunk, action.microbatch
        if hidden is not None:
            hidden.requires_grad_(not self.forward_only)
        start = self.clock()  # compute starts once the input has arrived: waiting is bubble
        store = self.job.weight_grads
        deferrable = store.deferrable() if store is not None and self.split else nullcontext()
        with torch.set_grad_enabled(not self.forward_only), deferrable:
            out = self.job.forward_step(self.chunks[c], self.microbatches[mb], hidden)
        end = self.clock()
        if self.stages.stage(self.r, c) == self.last_stage:
            out = self.scaling.microbatch_loss(out)
            self.losses.append(out.detach())
            if not self.forward_only:
                out = self.scaling.backward_loss(out)
        else:
            self.hand_on(action, out.detach().contiguous())
            if not self.forward_only:
                _release(out)
        if not self.forward_only:
            self.inputs[(c, mb)], self.outputs[(c, mb)] = hidden, out
        if self.record is not None:
            self.record.peak_live = max(self.record.peak_live, len(self.outputs))
        return start, end

    def backward(self, action: Action, grad: torch.Tensor | None, before: Callable[[], None] | None
                 ) -> tuple[float, float]:
        hidden, out = self.inputs.pop((action.chunk, action.microbatch)), self.outputs.pop((action.chunk,
                                                                                            action.microbatch))
        start = self.clock()
        if before is not None:
            before()
        store = self.job.weight_grads
        if store is not None and self.split:
            with store.collect((action.chunk, action.microbatch)):
                _backward(out, grad)
            if self.record is not None:
                self.record.peak_deferred = max(self.record.peak_deferred, store.pending())
                self.record.peak_deferred_bytes = max(self.record.peak_deferred_bytes, store.pending_bytes())
        else:
            _backward(out, grad)
        end = self.clock()
        self.hand_on(action, hidden.grad if hidden is not None else None)
        return start, end

    def prompt_weights(self, end: float) -> float:
        """After a B's batch is posted: the output layer's weight gradient it queued (none elsewhere);
        returns when B's work ended."""
        store = self.job.weight_grads
        if store is None or not self.split:
            return end
        store.run_prompt()
        return self.clock()

    def weights(self, action: Action, before: Callable[[], None] | None) -> tuple[float, float]:
        """W: the weight gradients the action's B queued (nothing without a store)."""
        start = self.clock()
        if before is not None:
            before()
        if self.job.weight_grads is not None:
            self.job.weight_grads.run((action.chunk, action.microbatch))
        return start, self.clock()

    def before_last(self, last_backward: Callable[[int, set | None], None], chunk: int) -> Callable[[], None]:
        store = self.job.weight_grads
        if not self.split or store is None:
            return lambda: last_backward(chunk, None)
        return lambda: last_backward(chunk, store.deferred.get(chunk, set()))

    def hand_on(self, action: Action, t: torch.Tensor | None) -> None:
        """What ``action`` produced, to the next stage: this round's send, or a hand-off on this rank."""
        out = produced(action, self.p, self.r, self.vp, self.stages)
        if out is None:
            return
        if out[0] == self.r:
            self.local[out[1]] = t
        else:
            self.outbox.append(t)

    def note(self, action: Action, start: float, end: float) -> None:
        if self.record is None:
            return
        if action.kind == "F":
            self.record.forward_s += end - start
        else:  # B and W: the backward's two halves
            self.record.backward_s += end - start
        if self.record.keep_timeline:
            self.record.timeline.append((action.kind, action.chunk, action.microbatch, start, end))


def run_table(tables: Sequence[Sequence[Action]], job: PipelinePass) -> list[torch.Tensor]:
    """Execute this rank's table of ``tables`` (one per pipeline rank: every rank plans the message rounds
    from all of them) for ``job``; returns the (detached) outputs of the last stage's micro-batches (the
    micro-batch losses, in training)."""
    run = _Run(job)
    pg, last_backward = job.pg, job.last_backward
    table = tables[run.r]
    run.split = any(a.kind == "W" for a in table)
    final = "W" if run.split else "B"
    last_of_chunk = {a.chunk: i for i, a in enumerate(table) if a.kind == final}
    plan = round_plan(tables, run.p, run.vp, run.stages)[run.r]
    done = 0
    for step in plan:
        action = step.action
        if action is None:
            run.exchange(step)
            continue
        assert action == table[done], f"round plan out of step with the table at {action}"
        received = run.take(action)
        before = None
        if last_backward is not None and action.kind == final and last_of_chunk[action.chunk] == done:
            before = run.before_last(last_backward, action.chunk)
        if action.kind == "F":
            start, end = run.forward(action, received)
        elif action.kind == "B":
            start, end = run.backward(action, received, before if not run.split else None)
        else:
            start, end = run.weights(action, before)
        run.exchange(step)  # B's input gradient leaves before the output layer's weight gradient runs
        if action.kind == "B":
            end = run.prompt_weights(end)
        run.note(action, start, end)
        done += 1
    for work in run.in_flight:
        work.wait()
    pg.end_step("pipeline pass")  # every batch of the pass waited on (checked when emulating or recording NCCL)
    return run.losses
