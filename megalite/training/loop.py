"""pretrain(): the training loop. One iteration = one global batch = one optimizer step.

sampler -> this DP rank's micro-batches -> pipeline schedule (forward/backward of this rank's chunks)
-> finalize grads (TP partials, tied embeddings, DP average) -> global grad norm, clip -> AdamW step
-> log / evaluate.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from megalite import device
from megalite.config.arguments import MegaliteConfig
from megalite.distributed.finalize import finalize_grads, tied_embedding_params
from megalite.distributed.grad_buffer import GradBuffer
from megalite.optimizer.lr_schedule import LRSchedule
from megalite.optimizer.optimizer import MegaliteOptimizer
from megalite.parallel.groups import ProcessGroups
from megalite.pipeline.executor import PipelineRecord
from megalite.pipeline.schedules import forward_backward
from megalite.tensor_parallel.random import model_parallel_seed
from megalite.training.batches import RunData, build_run_data, global_batch
from megalite.training.flops import training_flops
from megalite.training.log import format_iteration_line, format_validation_line
from megalite.training.resume import maybe_load, save
from megalite.training.setup import build_model


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # lm loss of every iteration
    grad_norms: list[float | None] = field(default_factory=list)  # None on a skipped (overflow) step
    loss_scales: list[float] = field(default_factory=list)
    skipped_iterations: int = 0
    nan_iterations: int = 0
    valid_losses: list[tuple[int, float]] = field(default_factory=list)
    chunks: list[nn.Module] = field(default_factory=list)
    optimizer: MegaliteOptimizer | None = None


def build_buffers(chunks: list[nn.Module], cfg: MegaliteConfig, pg: ProcessGroups) -> list[GradBuffer]:
    """One contiguous gradient buffer per model chunk (a tied embedding in a bucket of its own)."""
    grad_dtype = torch.bfloat16 if cfg.ddp.grad_reduce_in_bf16 else torch.float32
    return [GradBuffer(list(c.parameters()), pg, grad_dtype=grad_dtype, bucket_size=cfg.ddp.ddp_bucket_size,
                       distributed=cfg.ddp.use_distributed_optimizer, overlap=cfg.ddp.overlap_grad_reduce,
                       separate=tied_embedding_params([c])) for c in chunks]


def reported_loss(losses: list[torch.Tensor], pg: ProcessGroups) -> float:
    """Mean micro-batch loss over DP, computed on the last stage and shared with every stage."""
    t = torch.zeros(1, dtype=torch.float32, device=device.current_device())
    if pg.is_last_stage:
        t += torch.stack(losses).float().mean()
        pg.all_reduce(t, "dp")
        t /= pg.dp_size
    pg.broadcast(t, "pp", src_index=pg.pp_size - 1)
    return float(t)


@torch.no_grad()
def evaluate(chunks: list[nn.Module], dataset, start: int, cfg: MegaliteConfig, pg: ProcessGroups) -> float:
    for c in chunks:
        c.eval()
    losses: list[torch.Tensor] = []
    gbs = cfg.training.global_batch_size
    for k in range(cfg.training.eval_iters):
        mbs = global_batch(dataset, start + k * gbs, cfg, pg, device.current_device())
        losses += forward_backward(chunks, mbs, pg, forward_only=True)
    for c in chunks:
        c.train()
    return reported_loss(losses, pg)


def _write_timeline(cfg: MegaliteConfig, pg: ProcessGroups, record: PipelineRecord, vp: int) -> None:
    out = cfg.parallel.record_pipeline_timeline
    os.makedirs(out, exist_ok=True)
    p, t = cfg.parallel, cfg.training
    with open(os.path.join(out, f"rank{pg.rank:05d}.json"), "w") as f:
        json.dump({"rank": pg.rank, "pp_rank": pg.pp_rank, "pp": pg.pp_size, "tp_rank": pg.tp_rank,
                   "dp_rank": pg.dp_rank, "vp": vp,
                   "microbatches": t.global_batch_size // (t.micro_batch_size * pg.dp_size),
                   "schedule": p.pipeline_schedule, "peak_live": record.peak_live,
                   "timeline": record.timeline}, f)


def pretrain(cfg: MegaliteConfig, pg: ProcessGroups, data: RunData | None = None,
             log: Callable[[str], None] | None = None) -> TrainResult:
    """Train for --train-iters iterations; every rank returns the logged losses."""
    t, o = cfg.training, cfg.optimizer
    log = log or (lambda s: print(s, flush=True))
    say = log if pg.rank == pg.layout.world_size - 1 else (lambda s: None)  # the last rank logs, as Megatron
    tracker = model_parallel_seed(t.seed, pg.tp_rank, pg.pp_rank)
    data = data or build_run_data(cfg, pg)
    vocab = data.tokenizer.vocab_size
    dtype = cfg.precision.params_dtype
    chunks = build_model(cfg, pg, vocab, tracker, dtype)
    buffers = build_buffers(chunks, cfg, pg)
    optimizer = MegaliteOptimizer(buffers, cfg, pg)
    for c in chunks:
        c.train()
        c.register_forward_pre_hook(lambda *_: optimizer.wait_param_gather())
    schedule = LRSchedule(o.lr, o.min_lr, o.lr_warmup_iters, o.lr_decay_iters or t.train_iters, o.lr_decay_style)
    result = TrainResult(chunks=chunks, optimizer=optimizer)

    def last_backward(chunk: int) -> None:  # let this chunk's buckets start reducing during its backward
        buffers[chunk].last_microbatch = True

    ts = maybe_load(cfg, chunks, optimizer, pg, tracker, vocab, say)
    dev = device.current_device()
    tokens_per_iter = t.global_batch_size * cfg.model.seq_length
    flops_per_iter = training_flops(cfg.model, vocab, cfg.model.seq_length, tokens_per_iter)
    world = pg.layout.world_size
    ck = cfg.checkpoint
    window_start, window_iters = time.perf_counter(), 0

    while ts.iteration < t.train_iters:
        record = PipelineRecord() if cfg.parallel.record_pipeline_timeline else None
        microbatches = global_batch(data.train, ts.consumed_samples, cfg, pg, dev)
        optimizer.zero_grad()
        for b in buffers:
            b.last_microbatch = False
        loss_scale = optimizer.loss_scale
        losses = forward_backward(chunks, microbatches, pg, cfg.parallel.pipeline_schedule, record=record,
                                  loss_scale=loss_scale, last_backward=last_backward)
        finalize_grads(chunks, buffers, pg)
        lr = schedule(ts.iteration)
        step_result = optimizer.step(lr, o.clip_grad)
        grad_norm = step_result.grad_norm
        ts.iteration += 1
        ts.consumed_samples += t.global_batch_size
        loss = reported_loss(losses, pg)
        ts.skipped_iterations += step_result.skipped
        ts.nan_iterations += not math.isfinite(loss)
        result.losses.append(loss)
        result.grad_norms.append(grad_norm)
        result.loss_scales.append(loss_scale)
        window_iters += 1
        if record is not None:
            _write_timeline(cfg, pg, record, len(chunks))

        step = ts.iteration
        if step % t.log_interval == 0 or step == t.train_iters:
            device.synchronize()
            elapsed = (time.perf_counter() - window_start) / window_iters
            tflops = flops_per_iter / elapsed / world / 1e12
            peak = cfg.logging.peak_tflops or device.peak_tflops(dtype)
            say(format_iteration_line(step, t.train_iters, ts.consumed_samples, elapsed * 1e3, lr,
                                      t.global_batch_size, loss, loss_scale, grad_norm, ts.skipped_iterations,
                                      ts.nan_iterations, tokens_per_iter / elapsed, tflops,
                                      tflops / peak if peak else None))
            window_start, window_iters = time.perf_counter(), 0
        if data.valid is not None and t.eval_iters > 0 and step % t.eval_interval == 0 and step < t.train_iters:
            vloss = evaluate(chunks, data.valid, ts.valid_consumed, cfg, pg)
            ts.valid_consumed += t.eval_iters * t.global_batch_size
            result.valid_losses.append((step, vloss))
            say(format_validation_line(step, vloss))
            window_start = time.perf_counter()
        exiting = bool(t.exit_interval and step % t.exit_interval == 0)
        if ck.save and (step == t.train_iters or exiting or (ck.save_interval and step % ck.save_interval == 0)):
            save(cfg, ts, chunks, optimizer, pg, tracker, vocab, say)
            window_start = time.perf_counter()
        if exiting:
            say(f" exiting at iteration {step} (--exit-interval {t.exit_interval})")
            break
    result.skipped_iterations, result.nan_iterations = ts.skipped_iterations, ts.nan_iterations
    if data.valid is not None and t.eval_iters > 0 and ts.iteration == t.train_iters:
        vloss = evaluate(chunks, data.valid, ts.valid_consumed, cfg, pg)
        result.valid_losses.append((t.train_iters, vloss))
        say(format_validation_line(t.train_iters, vloss))
    return result
