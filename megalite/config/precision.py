"""Mixed precision, data-parallel reduction and sharding flags (Megatron-LM names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megalite.config.domain import MAX_COUNT, MAX_RANKS, at_least, count, fraction, positive, size
from megalite.config.flags import option

MAX_LOSS_SCALE = 2.0**64  # past fp16's range many times over: every step would overflow

if TYPE_CHECKING:
    import torch

# --data-parallel-sharding-strategy values (Megatron-FSDP's names): ZeRO-0, 1, 2, 3.
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass(kw_only=True)
class PrecisionConfig:
    """Mixed precision: fp16 with dynamic loss scaling, or bf16; fp32 main params either way."""

    fp16: bool = option(False, help="fp16 params and activations, fp32 main params, dynamic loss scaling.")
    bf16: bool = option(False, help="bf16 params and activations, fp32 main params and gradients.")
    loss_scale: float | None = option(None, help="Constant loss scale (fp16); default: dynamic scaling.",
                                     domain=positive(hi=MAX_LOSS_SCALE))
    initial_loss_scale: float = option(2.0**32, help="Initial dynamic loss scale.",
                                       domain=positive(hi=MAX_LOSS_SCALE))
    min_loss_scale: float = option(1.0, help="Dynamic loss scale never goes below this.",
                                   domain=positive(hi=MAX_LOSS_SCALE))
    loss_scale_window: int = option(1000, help="Clean iterations before the dynamic loss scale doubles.",
                                   domain=count())
    hysteresis: int = option(2, help="Overflowing iterations tolerated before the loss scale halves.",
                            domain=count())
    loss_scale_collapse_iters: int = option(
        20, help="Stop the run when this many consecutive iterations overflow with the loss scale already at "
        "--min-loss-scale (the model trains nothing then).", domain=count())

    @property
    def params_dtype(self) -> "torch.dtype":
        import torch  # lazily: the config (and tools/plan.py) stays importable without torch

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
        None, help="Gradient bucket size in elements; default max(40M, 1M x data-parallel size).",
        domain=size(MAX_COUNT))
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
    powersgd_rank: int = option(1, help="Rank of PowerSGD's low-rank approximation of each gradient bucket.",
                                domain=size(MAX_RANKS))
    grad_compression_warmup_steps: int = option(
        0, help="Steps whose gradients are reduced exactly before --grad-compression starts.",
        domain=at_least(0, MAX_COUNT))
    optimizer_offload_fraction: float = option(
        1.0, help="With --optimizer-cpu-offload, the fraction of this rank's optimizer elements (by parameter, "
        "in order) whose state and update live on the host; the rest stays on the device.",
        domain=fraction(lo_open=True))
    data_parallel_sharding_strategy: str | None = option(
        None, choices=SHARDING_STRATEGIES,
        help="What is sharded over data-parallel ranks: no_shard; optim (the optimizer state, as "
        "--use-distributed-optimizer); optim_grads (also the gradients: reduce-scattered every micro-batch); "
        "optim_grads_params (also the parameters: all-gathered per layer before its forward and backward). "
        "Default: optim with --use-distributed-optimizer, optim_grads_params with --use-megatron-fsdp, else "
        "no_shard.")
    use_megatron_fsdp: bool = option(
        False, help="Shard over data-parallel ranks with --data-parallel-sharding-strategy, optim_grads_params "
        "unless that flag says otherwise.")
    fsdp_keep_params_across_microbatches: bool = option(
        False, help="optim_grads_params: keep each layer's gathered parameters until the step's last backward "
        "(one all-gather per step instead of two per micro-batch; the chunk's full parameters stay held).")

    @property
    def sharding(self) -> str:
        """The effective --data-parallel-sharding-strategy (see its help for the defaults)."""
        if self.data_parallel_sharding_strategy is not None:
            return self.data_parallel_sharding_strategy
        if self.use_megatron_fsdp:
            return "optim_grads_params"
        return "optim" if self.use_distributed_optimizer else "no_shard"

    @property
    def shards_optimizer(self) -> bool:
        return self.sharding != "no_shard"

    @property
    def shards_grads(self) -> bool:
        return self.sharding in ("optim_grads", "optim_grads_params")

    @property
    def shards_params(self) -> bool:
        return self.sharding == "optim_grads_params"
