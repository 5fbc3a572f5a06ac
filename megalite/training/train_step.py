"""One training iteration, and evaluation: the pieces pretrain() strings together.

iteration: sampler -> this DP rank's micro-batches -> pipeline schedule (forward/backward of this
rank's chunks) -> finalize grads (DP reduction, TP partials, tied embeddings) -> optimizer (unscale,
found-inf, true global grad norm, clip, AdamW on fp32 main params, param all-gather).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from megalite import device
from megalite.config.arguments import MegaliteConfig
from megalite.distributed.compression import make_compressor
from megalite.distributed.finalize import finalize_grads, tied_embedding_params
from megalite.distributed.grad_buffer import GradBuffer
from megalite.distributed.param_shard import ParamGatherer, param_units
from megalite.model.forward_step import hidden_shape, lm_forward_step
from megalite.moe.balance import set_loss_scaling, update_expert_bias
from megalite.optimizer.lr_schedule import LRSchedule
from megalite.optimizer.optimizer import MegaliteOptimizer
from megalite.parallel.groups import Group, ProcessGroups
from megalite.parallel.loss_scaling import LossScaling
from megalite.pipeline.executor import PipelinePass, PipelineRecord
from megalite.pipeline.partition import loss_rank
from megalite.pipeline.schedules import forward_backward
from megalite.planning.memory import run_holds
from megalite.tensor_parallel.param_meta import FAMILIES, param_meta
from megalite.training.batches import RunData, global_batch
from megalite.training.resume import TrainState
from megalite.training.timers import Timers


def build_buffers(chunks: list[nn.Module], cfg: MegaliteConfig, pg: ProcessGroups) -> list[GradBuffer]:
    """Per parameter family (param_meta.FAMILIES: dense, then routed experts), one contiguous gradient
    buffer per model chunk holding that family's parameters, reduced over the family's DP group, in chunk
    order (a tied embedding in a bucket of its own). With sharded parameters (ZeRO-3) each buffer shards
    its family over that group, one bucket per layer, gathered by a ParamGatherer of its own."""
    dd = cfg.ddp
    grad_dtype = torch.bfloat16 if dd.grad_reduce_in_bf16 else torch.float32
    common = dict(grad_dtype=grad_dtype, bucket_size=dd.ddp_bucket_size, distributed=dd.shards_optimizer,
                  overlap=dd.overlap_grad_reduce, shard_grads=dd.shards_grads)
    buffers: dict[str, list[GradBuffer]] = {name: [] for name in FAMILIES}
    for i, c in enumerate(chunks):
        for name, family in FAMILIES.items():
            params = [p for p in c.parameters() if param_meta(p).family == family]
            if not params:
                continue
            units = [[p for p in unit if param_meta(p).family == family] for unit in param_units(c)]
            compressor = make_compressor(dd.grad_compression, pg, dd.powersgd_rank,
                                         dd.grad_compression_warmup_steps) if family.compress else None
            buf = GradBuffer(params, pg, separate=tied_embedding_params([c]), kind=family.dp_kind(pg),
                             units=units if dd.shards_params else None, compressor=compressor, chunk=i, **common)
            if buf.shard_params:
                ParamGatherer(c, buf, pg, keep=dd.fsdp_keep_params_across_microbatches)
            buffers[name].append(buf)
    return [b for family_buffers in buffers.values() for b in family_buffers]


def run_microbatches(chunks: list[nn.Module], microbatches: list[dict], pg: ProcessGroups,
                     scaling: LossScaling | None = None, schedule: str = "1f1b", **job) -> list[torch.Tensor]:
    """The GPT's micro-batches through this rank's pipeline schedule (see forward_backward); ``scaling``
    defaults to the layout's, without a loss scale. ``job``: the other fields of PipelinePass."""
    shape = hidden_shape(chunks[0], microbatches[0]["tokens"], pg.tp_size)
    scaling = scaling or LossScaling.of(pg, len(microbatches))
    return forward_backward(PipelinePass(chunks, microbatches, lm_forward_step, pg, shape, scaling=scaling, **job),
                            schedule)


def reported_loss(losses: list[torch.Tensor], pg: ProcessGroups, schedule: str = "1f1b") -> float:
    """Mean micro-batch loss over DP, computed on the stage that holds the loss (the last pipeline rank, or
    the first under ZB-V) and shared with every stage (the average over DP x CP of
    LossScaling.microbatch_loss, docs/design.md §3.9)."""
    t = torch.zeros(1, dtype=torch.float32, device=device.current_device())
    src = loss_rank(pg.pp_size, schedule)
    if pg.pp_rank == src:
        t += torch.stack(losses).float().mean()
        pg.all_reduce(t, pg.grad_kind)
        LossScaling.of(pg).reported(t)
    pg.broadcast(t, Group.PP, src_index=src)
    return float(t)


def step_scaling(cfg: MegaliteConfig, pg: ProcessGroups, microbatches: list[dict], loss_scale: float = 1.0
                 ) -> LossScaling:
    """The loss scaling of a step over ``microbatches``: per micro-batch, or per token of the global batch
    with --calculate-per-token-loss (one all-reduce of the token count over DP x CP)."""
    if cfg.training.calculate_per_token_loss:
        return LossScaling.per_token(pg, microbatches, loss_scale)
    return LossScaling.of(pg, len(microbatches), loss_scale)


def no_token_reason(cfg: MegaliteConfig) -> str:
    """Why a batch has no unmasked label: the flag that masked them (the loss masks of data/documents.py)."""
    if cfg.data.eod_mask_loss:
        return "--eod-mask-loss masks every label (every input token is the end-of-document token)"
    return "the loss mask covers every label"


def unmasked_tokens(pg: ProcessGroups, masks: list[torch.Tensor]) -> float:
    """The unmasked labels of ``masks`` summed over DP x CP, in fp64 (exact): one small all-reduce, asked only
    where a reported loss is exactly 0 (every rank sees the same reported loss, so every rank joins)."""
    local = torch.zeros(1, dtype=torch.float64, device=device.current_device())
    for mask in masks:
        local += mask.sum(dtype=torch.float64)
    pg.all_reduce(local, pg.grad_kind, label="token count")
    return float(local)


def _no_tokens(loss: float, scaling: LossScaling, pg: ProcessGroups, microbatches: list[dict]) -> bool:
    """Whether a step's global batch has no unmasked label: its loss, then 0 by the forward step's rule (a
    micro-batch with no token has loss 0), is not a loss. Counted only when the loss is exactly 0."""
    if loss != 0.0:
        return False
    if scaling.global_tokens is not None:
        return float(scaling.global_tokens) == 0
    return unmasked_tokens(pg, [mb["loss_mask"] for mb in microbatches]) == 0


@dataclass
class StepOutput:
    loss: float
    grad_norm: float | None  # None when the step was skipped (fp16 overflow)
    skipped: bool
    loss_scale: float
    record: PipelineRecord
    no_tokens: bool = False  # the global batch had no unmasked label: ``loss`` (0) is no loss


class TrainingRun(Protocol):
    """What a training step reads from the run (``training/loop.py:Run``)."""

    cfg: MegaliteConfig
    pg: ProcessGroups
    data: RunData
    chunks: list[nn.Module]
    buffers: list[GradBuffer]
    optimizer: MegaliteOptimizer
    schedule: LRSchedule
    state: TrainState


def train_step(run: TrainingRun, timers: Timers) -> StepOutput:
    """The run's next iteration, at the learning rates its schedule gives for the steps done so far."""
    cfg, pg, ts, optimizer = run.cfg, run.pg, run.state, run.optimizer
    done = (ts.iteration, ts.skipped_iterations, cfg.training.global_batch_size)
    record = PipelineRecord(keep_timeline=bool(cfg.parallel.record_pipeline_timeline),
                            synchronize=timers.level > 0)
    with timers.phase("batch-generator"):
        microbatches = global_batch(run.data.train, ts.consumed_samples, cfg, pg, device.current_device(),
                                    run.data.tokenizer.eod)
    optimizer.zero_grad()
    scaling = step_scaling(cfg, pg, microbatches, optimizer.loss_scale)
    microbatches = scaling.normalised(microbatches)
    set_loss_scaling(run.chunks, scaling)
    optimizer.wait_param_gather()  # the last step's updated parameters (overlapped until here)
    losses = _forward_backward(run, microbatches, scaling, record)
    timers.add("forward-compute", record.forward_s)
    timers.add("backward-compute", record.backward_s)
    timers.add("pipeline-wait", record.wait_s)
    with timers.phase("grads-reduce"):
        finalize_grads(run.chunks, run.buffers, pg)
    if cfg.training.empty_unused_memory_level >= 1:
        device.empty_cache()
    with timers.phase("optimizer"):
        result = optimizer.step(run.schedule.after(*done), cfg.optimizer.clip_grad,
                                run.schedule.after(*done, decoupled=True))
    update_expert_bias(run.chunks, pg)
    if cfg.training.empty_unused_memory_level >= 2:
        device.empty_cache()
    loss = reported_loss(losses, pg, cfg.parallel.pipeline_schedule)
    no_tokens = _no_tokens(loss, scaling, pg, microbatches)
    pg.end_step("training step")
    return StepOutput(loss, result.grad_norm, result.skipped, scaling.loss_scale, record, no_tokens)


def _forward_backward(run: TrainingRun, microbatches: list[dict], scaling: LossScaling, record: PipelineRecord
                      ) -> list[torch.Tensor]:
    """The step's pipeline pass; each chunk's buckets may start reducing during its last backward."""
    for b in run.buffers:
        b.last_microbatch = False

    def last_backward(chunk: int, deferred: set | None) -> None:
        for b in run.buffers:
            if b.chunk == chunk:
                b.last_microbatch = True
                if deferred is not None:  # split backward: what B computed is complete before the last W
                    b.mark_ready([p for p in b.ranges if p not in deferred])

    holds = run_holds(run.cfg, run.pg.layout.world_size, run.data.tokenizer.vocab_size)  # ZB: within 1F1B's bytes
    return run_microbatches(run.chunks, microbatches, run.pg, scaling, run.cfg.parallel.pipeline_schedule,
                            record=record, last_backward=last_backward, holds=holds)


@torch.no_grad()
def evaluate(chunks: list[nn.Module], dataset, start: int, cfg: MegaliteConfig, pg: ProcessGroups,
             eod: int | None = None) -> float | None:
    """The loss over --eval-iters global batches from sample ``start``, with the training micro-batches' masks
    (``eod``: the tokenizer's): the mean micro-batch loss, or with --calculate-per-token-loss the sum of all
    token losses over all their unmasked tokens (as Megatron-LM). None when no label was unmasked (where
    Megatron-LM reports 0, perplexity 1): there is no loss to report (see no_token_reason)."""
    for c in chunks:
        c.eval()
    losses: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    weighted, tokens = 0.0, 0.0
    gbs, schedule = cfg.training.global_batch_size, cfg.parallel.pipeline_schedule
    for k in range(cfg.training.eval_iters):
        mbs = global_batch(dataset, start + k * gbs, cfg, pg, device.current_device(), eod)
        scaling = step_scaling(cfg, pg, mbs)
        batch = run_microbatches(chunks, scaling.normalised(mbs), pg, scaling, schedule, forward_only=True)
        if scaling.global_tokens is None:
            losses += batch
            masks += [mb["loss_mask"] for mb in mbs]
        else:  # this batch's per-token mean, weighted by its token count
            count = float(scaling.global_tokens)
            weighted, tokens = weighted + reported_loss(batch, pg, schedule) * count, tokens + count
        if cfg.training.empty_unused_memory_level >= 1:
            device.empty_cache()
    for c in chunks:
        c.train()
    if cfg.training.calculate_per_token_loss:
        return weighted / tokens if tokens else None
    loss = reported_loss(losses, pg, schedule)
    return None if loss == 0.0 and unmasked_tokens(pg, masks) == 0 else loss


def write_timeline(cfg: MegaliteConfig, pg: ProcessGroups, record: PipelineRecord, vp: int) -> None:
    out = cfg.parallel.record_pipeline_timeline
    os.makedirs(out, exist_ok=True)
    p, t = cfg.parallel, cfg.training
    with open(os.path.join(out, f"rank{pg.rank:05d}.json"), "w") as f:
        json.dump({"rank": pg.rank, "pp_rank": pg.pp_rank, "pp": pg.pp_size, "tp_rank": pg.tp_rank,
                   "dp_rank": pg.dp_rank, "vp": vp, "written": time.time(),
                   "microbatches": t.global_batch_size // (t.micro_batch_size * pg.dp_size),
                   "schedule": p.pipeline_schedule, "peak_live": record.peak_live,
                   "timeline": record.timeline}, f)
