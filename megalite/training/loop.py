"""pretrain(): the training loop — set up, resume, iterate, log, evaluate, save, stop."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from megalite import compat, device
from megalite.checkpointing.async_save import AsyncSaver
from megalite.checkpointing.paths import iter_dirname
from megalite.config.arguments import MegaliteConfig
from megalite.distributed.grad_buffer import GradBuffer
from megalite.distributed.param_shard import full_params
from megalite.model.build import build_model
from megalite.model.mtp import window_mtp_losses
from megalite.moe.balance import window_metrics
from megalite.optimizer.lr_schedule import LRSchedule, schedule_from_config
from megalite.optimizer.optimizer import MegaliteOptimizer
from megalite.parallel.groups import ProcessGroups
from megalite.planning.vocab_balance import run_layout_hint
from megalite.tensor_parallel.random import RNGTracker, model_parallel_seed
from megalite.training.batches import RunData, build_run_data
from megalite.training.exit_conditions import ExitConditions
from megalite.training.log import LogWindow, format_validation_line
from megalite.training.manual_gc import ManualGC
from megalite.training.profiling import StepProfiler
from megalite.training.resume import TrainState, check_samples, maybe_load, save
from megalite.training.save_retry import SaveRetry
from megalite.training.timers import Timers
from megalite.training.train_step import (
    StepOutput,
    build_buffers,
    evaluate,
    no_token_reason,
    train_step,
    write_timeline,
)
from megalite.training.writers import MetricWriters


class NonFiniteError(RuntimeError):
    """The loss or grad norm was NaN/inf (checked unless --no-check-for-nan-in-loss-and-grad); the message
    names the rank and iteration."""


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
    mtp_losses: list[tuple[int, list[float]]] = field(default_factory=list)  # (iteration, "mtp_k loss"s) logged


def _logged_mtp(run: Run, losses: list[float]) -> list[float]:
    """The window's "mtp_k loss"s (--mtp-num-layers), kept in the result at the iteration logged."""
    run.result.mtp_losses.append((run.state.iteration, losses))
    return losses


@dataclass
class Run:
    """What one pretrain() call trains, and where it stands."""

    cfg: MegaliteConfig
    pg: ProcessGroups
    data: RunData
    tracker: RNGTracker
    chunks: list[nn.Module]
    buffers: list[GradBuffer]
    optimizer: MegaliteOptimizer
    schedule: LRSchedule
    state: TrainState
    result: TrainResult
    say: Callable[[str], None]
    gc: ManualGC
    saver: AsyncSaver | None = None  # --async-save: the save in flight, if any
    retry: SaveRetry | None = None  # periodic saves that failed to write: go on, up to a limit

    @property
    def vocab_size(self) -> int:
        return self.data.tokenizer.vocab_size

    @property
    def validating(self) -> bool:
        return self.data.valid is not None and self.cfg.training.eval_iters > 0

    def step(self, timers: Timers) -> StepOutput:
        """The next training iteration (training/train_step.py), not yet counted (see record)."""
        return train_step(self, timers)

    def record(self, out: StepOutput) -> int:
        """Count the step just taken; stop on a NaN unless --no-check-for-nan-in-loss-and-grad. Returns its number."""
        ts, t = self.state, self.cfg.training
        ts.iteration += 1
        ts.consumed_samples += t.global_batch_size
        ts.skipped_iterations += out.skipped
        finite = math.isfinite(out.loss) and (out.grad_norm is None or math.isfinite(out.grad_norm))
        ts.nan_iterations += not finite
        self.result.losses.append(out.loss)
        self.result.grad_norms.append(out.grad_norm)
        self.result.loss_scales.append(out.loss_scale)
        if t.check_for_nan_in_loss_and_grad and not finite:
            raise NonFiniteError(f"rank {self.pg.rank}: lm loss {out.loss} / grad norm {out.grad_norm} is not "
                                 f"finite at iteration {ts.iteration}; stopped before saving (lower --lr, check the "
                                 "data; --no-check-for-nan-in-loss-and-grad keeps training)")
        return ts.iteration

    def evaluate(self, writers: MetricWriters) -> None:
        """Validation loss over the next --eval-iters global batches of the validation set, logged."""
        t, step = self.cfg.training, self.state.iteration
        self.optimizer.wait_param_gather()
        with self.gc.around_eval():
            loss = evaluate(self.chunks, self.data.valid, self.state.valid_consumed, self.cfg, self.pg,
                            self.data.tokenizer.eod)
        self.state.valid_consumed += t.eval_iters * t.global_batch_size
        self.result.valid_losses.append((step, loss))
        self.say(format_validation_line(step, loss, why=no_token_reason(self.cfg)))
        writers.scalars({"validation/lm-loss": loss}, step)

    def save(self, final: bool = False) -> None:
        """Save this iteration (with --async-save: start writing it once the previous one is committed; the
        ``final`` save is waited for)."""
        self.commit_saved(wait=True, final=final)
        self.optimizer.wait_param_gather()
        with self.retry.attempt(final):
            with full_params(self.buffers):  # sharded parameters (ZeRO-3): the checkpoint stores full tensors
                save(self.cfg, self.state, self.chunks, self.optimizer, self.pg, self.tracker, self.vocab_size,
                     self.say, self.saver)
            if self.saver is None:
                self.retry.succeeded()
        if final:
            self.commit_saved(wait=True, final=True)

    def commit_saved(self, wait: bool, final: bool = False) -> None:
        """--async-save, at a step boundary on every rank: commit the save in flight once every rank wrote
        it (``wait``: wait for the writers first; ``final``: a failure ends the run even below the limit)."""
        if self.saver is None:
            return
        done = None
        with self.retry.attempt(final):
            done = self.saver.finish() if wait else self.saver.poll()
        if done is not None:
            self.retry.succeeded()
            path = os.path.join(done.save_dir, iter_dirname(done.iteration))
            self.say(f" saved checkpoint at iteration {done.iteration} to {path} (written in the background)")


def start_run(cfg: MegaliteConfig, pg: ProcessGroups, data: RunData | None, say: Callable[[str], None]) -> Run:
    """Data, model chunks, gradient buffers, optimizer and LR schedule; then --load's checkpoint, if any."""
    t, o = cfg.training, cfg.optimizer
    tracker = model_parallel_seed(t.seed, pg.tp_rank, pg.pp_rank, pg.cp_rank)
    data = data or build_run_data(cfg, pg)
    vocab = data.tokenizer.vocab_size
    chunks = build_model(cfg, pg, vocab, tracker, cfg.precision.params_dtype)
    if cfg.model.is_moe and cfg.model.moe_grouped_gemm:
        warning = compat.grouped_mm_warning(device.device_type(), cfg.precision.params_dtype)
        if warning:
            say(f" WARNING: {warning}")
    hint = run_layout_hint(cfg, pg.layout.world_size, vocab)
    if hint:
        say(f" NOTE: {hint}")
    buffers = build_buffers(chunks, cfg, pg)
    optimizer = MegaliteOptimizer(buffers, cfg, pg)
    for c in chunks:
        c.train()
    schedule = schedule_from_config(o, t)
    result = TrainResult(chunks=chunks, optimizer=optimizer)
    with full_params(buffers if cfg.checkpoint.load else [], write_back=True):
        state = maybe_load(cfg, chunks, optimizer, pg, tracker, vocab, say)
    check_samples(cfg, state, data.train, data.valid if t.eval_iters > 0 else None)
    saver = AsyncSaver(pg) if cfg.checkpoint.async_save else None
    retry = SaveRetry(cfg.checkpoint.max_consecutive_failed_saves, say)
    return Run(cfg, pg, data, tracker, chunks, buffers, optimizer, schedule, state, result, say, ManualGC(t), saver,
               retry)


def stop_reason(cfg: MegaliteConfig, exits: ExitConditions, step: int) -> str | None:
    """Why to stop after ``step`` (a signal, the time limit, --exit-interval), or None; agreed by all ranks."""
    t = cfg.training
    reason = exits.reason()
    if reason is None and t.exit_interval and step % t.exit_interval == 0:
        reason = f"--exit-interval {t.exit_interval}"
    return reason


def pretrain(cfg: MegaliteConfig, pg: ProcessGroups, data: RunData | None = None,
             log: Callable[[str], None] | None = None) -> TrainResult:
    """Train until --train-iters (or an exit condition); every rank returns the logged losses."""
    t, lg, ck = cfg.training, cfg.logging, cfg.checkpoint
    log = log or (lambda s: print(s, flush=True))
    is_logger = pg.rank == pg.layout.world_size - 1  # the last rank holds the loss, as in Megatron
    run = start_run(cfg, pg, data, log if is_logger else (lambda s: None))
    timers = Timers(lg.timing_log_level)
    writers = MetricWriters(lg, is_logger, cfg.to_dict())
    profiler = StepProfiler(lg.profile, lg.profile_step_start, lg.profile_step_end, lg.profile_dir, pg.rank,
                            lg.profile_ranks)
    exits = ExitConditions(t.exit_signal_handler, t.exit_duration_in_mins, pg)
    moe = (lambda: window_metrics(run.chunks, pg, cfg.model.num_layers + cfg.model.mtp_depths,
                                  cfg.model.num_experts)) \
        if cfg.model.is_moe else None
    mtp = (lambda: _logged_mtp(run, window_mtp_losses(run.chunks, pg, cfg.model.mtp_depths))) \
        if cfg.model.mtp_depths else None
    window = LogWindow(cfg, pg, run.vocab_size, timers, writers, run.say, moe, mtp)
    try:
        run.gc.start()
        while run.state.iteration < t.train_iters:
            profiler.before(run.state.iteration)
            out = run.step(timers)
            step = run.record(out)
            run.commit_saved(wait=False)
            if cfg.parallel.record_pipeline_timeline:
                write_timeline(cfg, pg, out.record, len(run.chunks))
            trace = profiler.after(step)
            if trace:
                run.say(f" wrote profiler trace {trace} (and one per profiled rank)")
            # Megatron logs the rate read back after its scheduler stepped: the next iteration's.
            window.step_done(run.state, run.schedule.after(step, run.state.skipped_iterations, t.global_batch_size),
                             out)
            if run.validating and step % t.eval_interval == 0 and step < t.train_iters:
                run.evaluate(writers)
                window.restart_clock()
            run.gc.after_step(step)
            reason = stop_reason(cfg, exits, step)
            if ck.save and (step == t.train_iters or reason or (ck.save_interval and step % ck.save_interval == 0)):
                run.save(final=step == t.train_iters or bool(reason))
                window.restart_clock()
            if reason:
                run.say(f" exiting at iteration {step}: {reason}")
                run.result.exit_reason = reason
                break
        run.commit_saved(wait=True, final=True)  # e.g. a periodic save still in flight when --train-iters ends unsaved
        run.optimizer.wait_param_gather()  # the returned chunks hold the last step's parameters
        if run.validating and run.state.iteration == t.train_iters:
            run.evaluate(writers)
    except BaseException:
        if run.saver is not None:  # no collectives now: the save in flight is dropped, the tracker kept
            run.saver.abandon()
        raise
    finally:
        run.gc.stop()
        writers.close()
    run.result.skipped_iterations, run.result.nan_iterations = run.state.skipped_iterations, run.state.nan_iterations
    return run.result


__all__ = ["NonFiniteError", "TrainResult", "pretrain"]
