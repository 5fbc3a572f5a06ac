"""Megatron's log line, which users' log parsers expect, plus throughput and MFU."""

from __future__ import annotations

import datetime


def format_iteration_line(iteration: int, train_iters: int, consumed: int, elapsed_ms: float, lr: float,
                          global_batch: int, loss: float, loss_scale: float, grad_norm: float | None,
                          skipped: int, nan: int, tokens_per_s: float | None = None,
                          tflops: float | None = None, mfu: float | None = None,
                          memory: dict[str, float] | None = None) -> str:
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    parts = [
        f" [{now}] iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {consumed:12d}",
        f"elapsed time per iteration (ms): {elapsed_ms:.1f}",
    ]
    if tflops is not None:
        parts.append(f"throughput per GPU (TFLOP/s/GPU): {tflops:.3f}")
    if mfu is not None:
        parts.append(f"MFU: {100.0 * mfu:.1f}%")
    if tokens_per_s is not None:
        parts.append(f"tokens per second: {tokens_per_s:.0f}")
    parts += [
        f"learning rate: {lr:.6E}",
        f"global batch size: {global_batch:5d}",
        f"lm loss: {loss:.6E}",
        f"loss scale: {loss_scale:.1f}",
    ]
    if grad_norm is not None:
        parts.append(f"grad norm: {grad_norm:.6f}")
    if memory:
        parts.append("memory (MB): " + ", ".join(f"{k.removesuffix('_mb')} {v:.0f}" for k, v in memory.items()))
    parts += [f"number of skipped iterations: {skipped:3d}", f"number of nan iterations: {nan:3d}"]
    return " | ".join(parts) + " |"


def format_validation_line(iteration: int, loss: float, label: str = "validation") -> str:
    import math

    ppl = math.exp(min(20.0, loss))
    return f" {label} loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"
