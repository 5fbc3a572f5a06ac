"""pretrain(): the training loop. One iteration = one global batch = one optimizer step.

sampler -> this DP rank's micro-batches -> forward/backward (schedule) -> finalize grads (TP partials,
tied embeddings, DP average) -> global grad norm, clip -> AdamW step -> log / evaluate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from megalite import device
from megalite.config.arguments import MegaliteConfig
from megalite.distributed.finalize import finalize_grads
from megalite.optimizer.adam import build_adam
from megalite.optimizer.clip import clip_grads, global_grad_norm
from megalite.optimizer.lr_schedule import LRSchedule
from megalite.parallel.groups import ProcessGroups
from megalite.pipeline.schedules import forward_backward_no_pipelining
from megalite.tensor_parallel.random import model_parallel_seed
from megalite.training.batches import RunData, build_run_data, global_batch
from megalite.training.flops import training_flops
from megalite.training.log import format_iteration_line, format_validation_line
from megalite.training.setup import build_model


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # lm loss of every iteration
    grad_norms: list[float] = field(default_factory=list)
    valid_losses: list[tuple[int, float]] = field(default_factory=list)
    model: nn.Module | None = None


def lm_loss(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean per-token loss of one micro-batch."""
    per_token = model(mb["tokens"], labels=mb["labels"])
    mask = mb["loss_mask"]
    return (per_token.float() * mask).sum() / mask.sum()


def _mean_over_dp(losses: list[torch.Tensor], pg: ProcessGroups) -> float:
    t = torch.stack(losses).mean().reshape(1).float()
    pg.all_reduce(t, "dp")
    return float(t) / pg.dp_size


@torch.no_grad()
def evaluate(model: nn.Module, dataset, start: int, cfg: MegaliteConfig, pg: ProcessGroups) -> float:
    model.eval()
    losses = []
    gbs = cfg.training.global_batch_size
    for k in range(cfg.training.eval_iters):
        mbs = global_batch(dataset, start + k * gbs, cfg, pg, device.current_device())
        losses += forward_backward_no_pipelining(model, mbs, lm_loss, forward_only=True)
    model.train()
    return _mean_over_dp(losses, pg)


def pretrain(cfg: MegaliteConfig, pg: ProcessGroups, data: RunData | None = None,
             log: Callable[[str], None] | None = None) -> TrainResult:
    """Train for --train-iters iterations; every rank returns the logged losses."""
    t, o = cfg.training, cfg.optimizer
    log = log or (lambda s: print(s, flush=True))
    say = log if pg.rank == pg.layout.world_size - 1 else (lambda s: None)  # last rank holds the loss
    tracker = model_parallel_seed(t.seed, pg.tp_rank, pg.pp_rank)
    data = data or build_run_data(cfg, pg)
    vocab = data.tokenizer.vocab_size
    model = build_model(cfg, pg, vocab, tracker)
    model.train()
    optimizer = build_adam([model], o)
    schedule = LRSchedule(o.lr, o.min_lr, o.lr_warmup_iters, o.lr_decay_iters or t.train_iters, o.lr_decay_style)
    params = [p for p in model.parameters() if p.requires_grad]
    result = TrainResult(model=model)
    dev = device.current_device()
    tokens_per_iter = t.global_batch_size * cfg.model.seq_length
    flops_per_iter = training_flops(cfg.model, vocab, cfg.model.seq_length, tokens_per_iter)
    world = pg.layout.world_size
    consumed, valid_consumed = 0, 0
    window_start, window_iters = time.perf_counter(), 0

    for iteration in range(t.train_iters):
        microbatches = global_batch(data.train, consumed, cfg, pg, dev)
        losses = forward_backward_no_pipelining(model, microbatches, lm_loss)
        finalize_grads([model], pg)
        grad_norm = global_grad_norm(params, pg)
        clip_grads(params, o.clip_grad, grad_norm)
        lr = schedule(iteration)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        consumed += t.global_batch_size
        loss = _mean_over_dp(losses, pg)
        result.losses.append(loss)
        result.grad_norms.append(grad_norm)
        window_iters += 1

        step = iteration + 1
        if step % t.log_interval == 0 or step == t.train_iters:
            device.synchronize()
            elapsed = (time.perf_counter() - window_start) / window_iters
            tflops = flops_per_iter / elapsed / world / 1e12
            peak = cfg.logging.peak_tflops or device.peak_tflops(torch.float32)
            say(format_iteration_line(step, t.train_iters, consumed, elapsed * 1e3, lr, t.global_batch_size,
                                      loss, 1.0, grad_norm, 0, 0, tokens_per_iter / elapsed, tflops,
                                      tflops / peak if peak else None))
            window_start, window_iters = time.perf_counter(), 0
        if data.valid is not None and t.eval_iters > 0 and step % t.eval_interval == 0 and step < t.train_iters:
            vloss = evaluate(model, data.valid, valid_consumed, cfg, pg)
            valid_consumed += t.eval_iters * t.global_batch_size
            result.valid_losses.append((step, vloss))
            say(format_validation_line(step, vloss))
            window_start = time.perf_counter()
    if data.valid is not None and t.eval_iters > 0:
        vloss = evaluate(model, data.valid, valid_consumed, cfg, pg)
        result.valid_losses.append((t.train_iters, vloss))
        say(format_validation_line(t.train_iters, vloss))
    return result
