"""The one constant of the time model taken from training-throughput rows: each GPU's sustained share
(megalite/planning/hardware.py, GPUSpec.sustained_share) of its achievable GEMM and flash-attention figures
over a training step. It stands for what the kernel benchmarks behind those figures do not see: clocks
under a whole node's power draw, the gaps between kernels, the SMs and memory bandwidth overlapped communication takes.

It is calibrated on the rows the planner has already seen, named here and never held out again
(docs/planning.md, "Between rounds 4 and 5"): the development rows (published.py) and
the held-out rounds' rows (heldout.py: rounds 1 to 4), each seen at its round's first and only run;
round 5's (heldout_v5.py) stay held out. The
share of a GPU is the one at which the median signed error of its rows is zero (bisection: the error falls
as the share does). Rows of a GPU with no calibration rows take the share of the GPU ``hardware.BORROWED``
names.

The calibration plans each row as its round did, with two settings its source implies and the round did
not model: Megatron-Core and NeMo runs keep Transformer Engine's activations (``--model-te-layers``), and
torchtitan's FSDP2 prefetches the next unit's weights (``--overlap-param-gather``).
"""

from __future__ import annotations

import dataclasses
import statistics

from megalite.planning.hardware import BORROWED
from tests.planning_rows.heldout import HELD_OUT, HELD_OUT_V2, HELD_OUT_V3, HELD_OUT_V4, HeldOutRun, plan_row
from tests.planning_rows.published import PUBLISHED, cluster_flags, run_flags

TE_SOURCES = ("DG-", "L3-")  # NeMo and Llama 3's Megatron-based runs; the README's H100 rows below
FSDP2_SOURCES = ("TT-",)


def _gpu(run: HeldOutRun) -> str:
    return run.cluster[run.cluster.index("--gpu") + 1]


def _development(run) -> HeldOutRun:
    flags = run_flags(run)
    cluster = cluster_flags(run) + (["--model-te-layers"] if run.gpu == "h100-sxm" else [])
    return HeldOutRun(f"{run.gpu}-{run.name}", run.source, tuple(flags[2:]), (), tuple(cluster), run.layers,
                      run.tflops_per_gpu, run.counts_recompute)


def _as_calibrated(run: HeldOutRun) -> HeldOutRun:
    cluster = (*run.cluster, "--model-te-layers") if run.id.startswith(TE_SOURCES) else run.cluster
    layout = (*run.layout, "--overlap-param-gather") if run.id.startswith(FSDP2_SOURCES) else run.layout
    return dataclasses.replace(run, cluster=cluster, layout=layout)


def calibration_rows(gpu: str | None = None) -> list[HeldOutRun]:
    """The seen rows (all, or one GPU's), with the settings the calibration plans them with."""
    rows = [_development(r) for r in PUBLISHED] + [_as_calibrated(r) for r in HELD_OUT + HELD_OUT_V2]
    rows += HELD_OUT_V3 + HELD_OUT_V4
    return [r for r in rows if gpu is None or _gpu(r) == gpu]


def row_error(run: HeldOutRun, share: float | None = None) -> float:
    """Predicted over published TFLOP/s per GPU, minus 1 (at ``share``, or the preset's)."""
    if share is not None:
        run = dataclasses.replace(run, cluster=(*run.cluster, "--sustained-share", repr(share)))
    return plan_row(run)[1] / run.tflops_per_gpu - 1


def calibrated_share(gpu: str, lo: float = 0.3, hi: float = 1.0, steps: int = 14) -> float:
    """The share at which the median signed error of ``gpu``'s calibration rows is zero."""
    rows = calibration_rows(BORROWED.get(gpu, gpu))
    if not rows:
        raise ValueError(f"no calibration rows for {gpu}")
    for _ in range(steps):
        mid = (lo + hi) / 2
        if statistics.median(row_error(r, mid) for r in rows) > 0:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2
