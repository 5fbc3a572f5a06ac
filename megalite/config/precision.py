"""Mixed precision, data-parallel reduction and distributed-optimizer flags (Megatron-LM names)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.config.flags import option


@dataclass(kw_only=True)
class PrecisionConfig:
    """Mixed precision: fp16 with dynamic loss scaling, or bf16; fp32 main params either way."""

    fp16: bool = option(False, help="fp16 params and activations, fp32 main params, dynamic loss scaling.")
    bf16: bool = option(False, help="bf16 params and activations, fp32 main params and gradients.")
    loss_scale: float | None = option(None, help="Constant loss scale (fp16); default: dynamic scaling.")
    initial_loss_scale: float = option(2.0**32, help="Initial dynamic loss scale.")
    min_loss_scale: float = option(1.0, help="Dynamic loss scale never goes below this.")
    loss_scale_window: int = option(1000, help="Clean iterations before the dynamic loss scale doubles.")
    hysteresis: int = option(2, help="Overflowing iterations tolerated before the loss scale halves.")
    loss_scale_collapse_iters: int = option(
        20, help="Stop the run when this many consecutive iterations overflow with the loss scale already at "
        "--min-loss-scale (the model trains nothing then).")

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.float16 if self.fp16 else torch.bfloat16 if self.bf16 else torch.float32


@dataclass(kw_only=True)
class DDPConfig:
    """Data parallelism: gradient buffers, buckets, overlap, and the sharded (distributed) optimizer."""

    use_distributed_optimizer: bool = option(
        False, help="Shard fp32 main params and Adam moments over data-parallel ranks (reduce-scatter grads, "
        "all-gather params).")
    overlap_grad_reduce: bool = option(
        False, help="Start each gradient bucket's reduction during the last micro-batch's backward.")
    overlap_param_gather: bool = option(
        False, help="With the distributed optimizer, all-gather updated params asynchronously and wait for "
        "them only before the next forward.")
    ddp_bucket_size: int | None = option(
        None, help="Gradient bucket size in elements; default max(40M, 1M x data-parallel size).")
    grad_reduce_in_bf16: bool = option(
        False, help="Accumulate and reduce gradients in bf16 (halves DP traffic; less exact).")
    optimizer_cpu_offload: bool = option(
        False, help="Keep the fp32 main params and Adam moments of --optimizer-offload-fraction of this rank's "
        "optimizer slice in a separate host-memory pool (pinned where the build supports it) and run their AdamW "
        "update on the host: gradients copied device-to-host, parameters host-to-device (on GPUs on a side "
        "stream, overlapped with the device's own update). Same math as without it; on CPU-only runs the pool "
        "and the copies are still separate, so the path is exercised.")
    grad_compression: str = option(
        "none", choices=["none", "powersgd", "int8"],
        help="Compress the data-parallel gradient all-reduce (inter-node part only with --hierarchical-dp-reduce), "
        "with error feedback: powersgd (rank --powersgd-rank, 4r(rows+cols) bytes per bucket instead of 4n) or "
        "int8 (about 2n bytes). Changes the math (approximate sums); not with the distributed optimizer.")
    powersgd_rank: int = option(1, help="Rank of PowerSGD's low-rank approximation of each gradient bucket.")
    grad_compression_warmup_steps: int = option(
        0, help="Steps whose gradients are reduced exactly before --grad-compression starts.")
    optimizer_offload_fraction: float = option(
        1.0, help="With --optimizer-cpu-offload, the fraction of this rank's optimizer elements (by parameter, "
        "in order) whose state and update live on the host; the rest stays on the device.")
