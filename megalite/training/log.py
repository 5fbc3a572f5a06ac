"""Megatron's log line, which users' log parsers expect, plus throughput and MFU, and the logging window
that produces it every --log-interval iterations."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass

from megalite import device
from megalite.config.arguments import MegaliteConfig
from megalite.parallel.groups import ProcessGroups
from megalite.planning.flops import training_flops
from megalite.training.resume import TrainState
from megalite.training.timers import Timers
from megalite.training.train_step import StepOutput, no_token_reason
from megalite.training.writers import MetricWriters

COMM_WARN_SHARE = 0.30  # the checklist: communication under 30% of the step
IMBALANCE_WARN = 1.2  # and no rank computing 20% longer than another


@dataclass(frozen=True, kw_only=True)
class IterationLine:
    """What one iteration line shows: progress, the step's results, and the window's speed; the optional
    parts (None or empty) are left out of the line."""

    iteration: int
    train_iters: int
    consumed: int  # samples
    elapsed_ms: float  # per iteration, over the window
    lr: float
    global_batch: int
    loss: float
    loss_scale: float
    grad_norm: float | None  # None: the step was skipped
    skipped: int  # iterations so far
    nan: int
    tokens_per_s: float | None = None
    tflops: float | None = None  # per device
    mfu: float | None = None
    memory: dict[str, float] | None = None
    moe: dict | None = None  # window_metrics' means over the MoE layers
    no_tokens: bool = False  # the step's global batch had no unmasked label: ``loss`` is no loss
    mtp: list[float] | None = None  # --mtp-num-layers: each depth's loss over the window ("mtp_k loss")


def format_iteration_line(line: IterationLine) -> str:
    """Megatron's iteration line for ``line``."""
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    parts = [
        f" [{now}] iteration {line.iteration:8d}/{line.train_iters:8d}",
        f"consumed samples: {line.consumed:12d}",
        f"elapsed time per iteration (ms): {line.elapsed_ms:.1f}",
    ]
    if line.tflops is not None:
        parts.append(f"throughput per GPU (TFLOP/s/GPU): {line.tflops:.3f}")
    if line.mfu is not None:
        parts.append(f"MFU: {100.0 * line.mfu:.1f}%")
    if line.tokens_per_s is not None:
        parts.append(f"tokens per second: {line.tokens_per_s:.0f}")
    parts += [
        f"learning rate: {line.lr:.6E}",
        f"global batch size: {line.global_batch:5d}",
        "lm loss: none (no unmasked token)" if line.no_tokens else f"lm loss: {line.loss:.6E}",
        *(f"mtp_{k + 1} loss: {x:.6E}" for k, x in enumerate(line.mtp or [])),  # Megatron's place: after lm loss
        f"loss scale: {line.loss_scale:.1f}",
    ]
    if line.moe:  # means over the MoE layers of this logging window
        parts.append(f"load balancing loss: {line.moe['load_balancing_loss']:.6E}")
        if line.moe["z_loss"]:
            parts.append(f"z loss: {line.moe['z_loss']:.6E}")
        parts += [f"expert imbalance (max/mean): {line.moe['imbalance']:.3f}",
                  f"dropped tokens: {100.0 * line.moe['dropped_fraction']:.2f}%"]
    if line.grad_norm is not None:
        parts.append(f"grad norm: {line.grad_norm:.6f}")
    if line.memory:
        parts.append("memory (MB): " + ", ".join(f"{k.removesuffix('_mb')} {v:.0f}" for k, v in line.memory.items()))
    parts += [f"number of skipped iterations: {line.skipped:3d}",
              f"number of nan iterations: {line.nan:3d}"]
    return " | ".join(parts) + " |"


def format_validation_line(iteration: int, loss: float | None, label: str = "validation", why: str | None = None
                           ) -> str:
    """Megatron's validation line; ``loss`` None (no unmasked label in the batches) says so, and ``why``
    (no_token_reason: the flag that masked them), instead of a loss of 0 and a perplexity of 1."""
    import math

    if loss is None:
        return (f" {label} loss at iteration {iteration} | no unmasked token in the {label} batches: "
                f"{why or 'the loss mask covers every label'}; no loss to report |")
    ppl = math.exp(min(20.0, loss))
    return f" {label} loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"


def moe_scalars(moe: dict | None) -> dict[str, float]:
    """TensorBoard / W&B names of the MoE metrics: the means over layers and each layer's own."""
    if not moe:
        return {}
    keys = ("load_balancing_loss", "z_loss", "imbalance", "dropped_fraction")
    out = {f"moe/{k}": moe[k] for k in keys}
    for n, row in moe["layers"].items():
        out.update({f"moe/layer_{n}/{k}": row[k] for k in keys})
    return out


class LogWindow:
    """The iterations since the last log line. Their wall time per iteration gives the throughput and MFU
    of the line logged every --log-interval iterations and at the last one, with the timers' breakdown."""

    def __init__(self, cfg: MegaliteConfig, pg: ProcessGroups, vocab_size: int, timers: Timers,
                 writers: MetricWriters, say: Callable[[str], None], moe: Callable[[], dict] | None = None,
                 mtp: Callable[[], list[float]] | None = None) -> None:
        """``moe``: returns (and clears) the MoE layers' metrics of the window (every rank calls it); ``mtp``
        likewise the MTP depths' losses."""
        self.cfg, self.pg, self.timers, self.writers, self.say = cfg, pg, timers, writers, say
        self.moe, self.mtp = moe, mtp
        m = cfg.model
        self.tokens_per_iter = cfg.training.global_batch_size * m.seq_length
        self.flops_per_iter = training_flops(m, vocab_size, m.seq_length, self.tokens_per_iter)
        self.peak = cfg.logging.peak_tflops or device.peak_tflops(cfg.precision.params_dtype)
        self.start, self.iters = time.perf_counter(), 0
        self.said_no_tokens = False

    def restart_clock(self) -> None:
        """Leave out of the window the time of what ran besides training (evaluation, a save)."""
        self.start = time.perf_counter()

    def step_done(self, state: TrainState, lr: float, out: StepOutput) -> None:
        """Count the step just finished; log the window when it is due (on every rank: timers reduce)."""
        self.iters += 1
        t = self.cfg.training
        if out.no_tokens and not self.said_no_tokens:  # once: later such steps log "lm loss: none"
            self.said_no_tokens = True
            self.say(f" WARNING: iteration {state.iteration}: no unmasked token in the global batch: "
                     f"{no_token_reason(self.cfg)}; the step has no loss (logged as 'lm loss: none', not 0)")
        if state.iteration % t.log_interval == 0 or state.iteration == t.train_iters:
            self._log(state, lr, out)
            self.timers.reset()
            self.start, self.iters = time.perf_counter(), 0

    def _log(self, state: TrainState, lr: float, out: StepOutput) -> None:
        device.synchronize()
        t, step = self.cfg.training, state.iteration
        elapsed = (time.perf_counter() - self.start) / self.iters
        tflops = self.flops_per_iter / elapsed / self.pg.layout.world_size / 1e12
        mfu = tflops / self.peak if self.peak else None
        timer_line, timer_vals = self.timers.report(self.pg, self.iters, elapsed) if self.timers.level else ("", {})
        memory = device.memory_stats() if self.cfg.logging.log_memory else {}
        moe = self.moe() if self.moe is not None else None
        mtp = self.mtp() if self.mtp is not None else None
        speed = dict(tokens_per_s=self.tokens_per_iter / elapsed, tflops=tflops, mfu=mfu) \
            if self.cfg.logging.log_throughput else {}
        self.say(format_iteration_line(IterationLine(
            iteration=step, train_iters=t.train_iters, consumed=state.consumed_samples, elapsed_ms=elapsed * 1e3,
            lr=lr, global_batch=t.global_batch_size, loss=out.loss, loss_scale=out.loss_scale,
            grad_norm=out.grad_norm, skipped=state.skipped_iterations, nan=state.nan_iterations, memory=memory,
            moe=moe, no_tokens=out.no_tokens, mtp=mtp, **speed)))
        if timer_line:
            self.say(timer_line)
            self._warn(timer_vals)
        self.writers.scalars({"lm-loss": None if out.no_tokens else out.loss, "learning-rate": lr,
                              "grad-norm": out.grad_norm, "loss-scale": out.loss_scale,
                              "tokens-per-second": self.tokens_per_iter / elapsed,
                              "tflops-per-device": tflops, "mfu": mfu,
                              **{f"memory/{k}": v for k, v in memory.items()},
                              **{f"time/{k}": v for k, v in timer_vals.items()}, **moe_scalars(moe),
                              **{f"mtp_{k + 1} loss": x for k, x in enumerate(mtp or [])}}, step)

    def _warn(self, timer_vals: dict[str, float]) -> None:
        if timer_vals["communication_share"] > COMM_WARN_SHARE:
            self.say(f" WARNING: communication is {timer_vals['communication_share']:.0%} of the step "
                     f"(> {COMM_WARN_SHARE:.0%}): see docs/troubleshooting.md ('slow')")
        if timer_vals["imbalance"] > IMBALANCE_WARN:
            self.say(f" WARNING: the slowest rank computes {timer_vals['imbalance']:.2f}x the fastest: "
                     "pipeline stages (or data) are unbalanced; see docs/troubleshooting.md ('slow')")
