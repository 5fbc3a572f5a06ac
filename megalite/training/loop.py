"""pretrain(): the training loop — set up, resume, iterate, log, evaluate, save, stop."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from megalite import device
from megalite.config.arguments import MegaliteConfig
from megalite.model.build import build_model
from megalite.optimizer.lr_schedule import LRSchedule
from megalite.optimizer.optimizer import MegaliteOptimizer
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.random import model_parallel_seed
from megalite.training.batches import RunData, build_run_data
from megalite.training.exit_conditions import ExitConditions
from megalite.training.flops import training_flops
from megalite.training.log import format_iteration_line, format_validation_line
from megalite.training.profiling import StepProfiler
from megalite.training.resume import maybe_load, save
from megalite.training.step import build_buffers, evaluate, train_step, write_timeline
from megalite.training.timers import Timers
from megalite.training.writers import MetricWriters

COMM_WARN_SHARE = 0.30  # the checklist: communication under 30% of the step
IMBALANCE_WARN = 1.2  # and no rank computing 20% longer than another


class NonFiniteError(RuntimeError):
    """--check-for-nan-in-loss-and-grad found a NaN/inf; the message names the rank and iteration."""


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # lm loss of every iteration run here
    grad_norms: list[float | None] = field(default_factory=list)  # None on a skipped (overflow) step
    loss_scales: list[float] = field(default_factory=list)
    skipped_iterations: int = 0
    nan_iterations: int = 0
    valid_losses: list[tuple[int, float]] = field(default_factory=list)
    exit_reason: str | None = None
    chunks: list[nn.Module] = field(default_factory=list)
    optimizer: MegaliteOptimizer | None = None


def pretrain(cfg: MegaliteConfig, pg: ProcessGroups, data: RunData | None = None,
             log: Callable[[str], None] | None = None) -> TrainResult:
    """Train until --train-iters (or an exit condition); every rank returns the logged losses."""
    t, o, lg, ck = cfg.training, cfg.optimizer, cfg.logging, cfg.checkpoint
    log = log or (lambda s: print(s, flush=True))
    is_logger = pg.rank == pg.layout.world_size - 1  # the last rank holds the loss, as in Megatron
    say = log if is_logger else (lambda s: None)
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
    ts = maybe_load(cfg, chunks, optimizer, pg, tracker, vocab, say)

    timers = Timers(lg.timing_log_level)
    writers = MetricWriters(lg, is_logger, cfg.to_dict())
    profiler = StepProfiler(lg.profile, lg.profile_step_start, lg.profile_step_end, lg.profile_dir, pg.rank,
                            lg.profile_ranks)
    exits = ExitConditions(t.exit_signal_handler, t.exit_duration_in_mins, pg.layout.world_size)
    tokens_per_iter = t.global_batch_size * cfg.model.seq_length
    flops_per_iter = training_flops(cfg.model, vocab, cfg.model.seq_length, tokens_per_iter)
    peak = lg.peak_tflops or device.peak_tflops(dtype)
    window_start, window_iters = time.perf_counter(), 0

    try:
        while ts.iteration < t.train_iters:
            profiler.before(ts.iteration)
            lr = schedule(ts.iteration)
            out = train_step(chunks, buffers, optimizer, data.train, ts.consumed_samples, lr, cfg, pg, timers)
            ts.iteration += 1
            ts.consumed_samples += t.global_batch_size
            ts.skipped_iterations += out.skipped
            finite = math.isfinite(out.loss) and (out.grad_norm is None or math.isfinite(out.grad_norm))
            ts.nan_iterations += not finite
            result.losses.append(out.loss)
            result.grad_norms.append(out.grad_norm)
            result.loss_scales.append(out.loss_scale)
            window_iters += 1
            step = ts.iteration
            if t.check_for_nan_in_loss_and_grad and not finite:
                raise NonFiniteError(f"rank {pg.rank}: lm loss {out.loss} / grad norm {out.grad_norm} is not finite "
                                     f"at iteration {step} (--check-for-nan-in-loss-and-grad)")
            if cfg.parallel.record_pipeline_timeline:
                write_timeline(cfg, pg, out.record, len(chunks))
            trace = profiler.after(step)
            if trace:
                say(f" wrote profiler trace {trace} (and one per profiled rank)")

            if step % t.log_interval == 0 or step == t.train_iters:
                device.synchronize()
                elapsed = (time.perf_counter() - window_start) / window_iters
                tflops = flops_per_iter / elapsed / pg.layout.world_size / 1e12
                mfu = tflops / peak if peak else None
                timer_line, timer_vals = timers.report(pg, window_iters, elapsed) if timers.level else ("", {})
                memory = device.memory_stats() if lg.log_memory else {}
                say(format_iteration_line(step, t.train_iters, ts.consumed_samples, elapsed * 1e3, lr,
                                          t.global_batch_size, out.loss, out.loss_scale, out.grad_norm,
                                          ts.skipped_iterations, ts.nan_iterations, tokens_per_iter / elapsed,
                                          tflops, mfu, memory))
                if timer_line:
                    say(timer_line)
                    if timer_vals["communication_share"] > COMM_WARN_SHARE:
                        say(f" WARNING: communication is {timer_vals['communication_share']:.0%} of the step "
                            f"(> {COMM_WARN_SHARE:.0%}): see docs/troubleshooting.md ('slow')")
                    if timer_vals["imbalance"] > IMBALANCE_WARN:
                        say(f" WARNING: the slowest rank computes {timer_vals['imbalance']:.2f}x the fastest: "
                            "pipeline stages (or data) are unbalanced; see docs/troubleshooting.md ('slow')")
                writers.scalars({"lm-loss": out.loss, "learning-rate": lr, "grad-norm": out.grad_norm,
                                 "loss-scale": out.loss_scale, "tokens-per-second": tokens_per_iter / elapsed,
                                 "tflops-per-device": tflops, "mfu": mfu,
                                 **{f"memory/{k}": v for k, v in memory.items()},
                                 **{f"time/{k}": v for k, v in timer_vals.items()}}, step)
                timers.reset()
                window_start, window_iters = time.perf_counter(), 0

            if data.valid is not None and t.eval_iters > 0 and step % t.eval_interval == 0 and step < t.train_iters:
                vloss = evaluate(chunks, data.valid, ts.valid_consumed, cfg, pg)
                ts.valid_consumed += t.eval_iters * t.global_batch_size
                result.valid_losses.append((step, vloss))
                say(format_validation_line(step, vloss))
                writers.scalars({"validation/lm-loss": vloss}, step)
                window_start = time.perf_counter()

            reason = exits.reason()
            if reason is None and t.exit_interval and step % t.exit_interval == 0:
                reason = f"--exit-interval {t.exit_interval}"
            if ck.save and (step == t.train_iters or reason or (ck.save_interval and step % ck.save_interval == 0)):
                save(cfg, ts, chunks, optimizer, pg, tracker, vocab, say)
                window_start = time.perf_counter()
            if reason:
                say(f" exiting at iteration {step}: {reason}")
                result.exit_reason = reason
                break

        if data.valid is not None and t.eval_iters > 0 and ts.iteration == t.train_iters:
            vloss = evaluate(chunks, data.valid, ts.valid_consumed, cfg, pg)
            result.valid_losses.append((t.train_iters, vloss))
            say(format_validation_line(t.train_iters, vloss))
            writers.scalars({"validation/lm-loss": vloss}, t.train_iters)
    finally:
        writers.close()
    result.skipped_iterations, result.nan_iterations = ts.skipped_iterations, ts.nan_iterations
    return result


__all__ = ["NonFiniteError", "TrainResult", "pretrain"]
