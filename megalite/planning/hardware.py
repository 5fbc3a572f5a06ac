"""The cluster a plan is for: GPU presets (public spec-sheet figures) and the --num-nodes ... flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from megalite.config.domain import MAX_RANKS, at_least, fraction, positive, size
from megalite.config.flags import domain_errors, option

MAX_FIGURE = 1e9  # TFLOP/s, GB or GB/s per GPU: a figure past this is a typo
# This machine (2 cores), one run of `OMP_NUM_THREADS=1 python bench/measure_cpu.py` (a rank's threads, as the
# bench runs them; torch 2.13.0, load average 0.9 at the start, 1.0 at the end; bench/README.md has the run):
CPU_FP32_TFLOPS, CPU_BF16_TFLOPS = 0.094, 0.430  # best square matmul (bf16 as this CPU runs it)
CPU_MEMORY_GBPS, CPU_GLOO_GBPS, CPU_MEMORY_GB = 36.2, 1.71, 25.3  # copy read + written; gloo bus bw, 2 procs
# an autograd operator on a tiny tensor, forward + backward, in us; an fp32 bernoulli_'s G elements/s; an fp32
# GeLU's GB/s, read + written
CPU_OP_US, CPU_MASK_GELEMS, CPU_ELEMENTWISE_GBPS = 5.85, 0.215, 15.4


@dataclass(frozen=True)
class GPUSpec:
    """One device's public figures. Bandwidths are GB/s per device in one direction; the achievable GEMM
    peak, SM count and attention share feed the per-GEMM time model (planning/kernels.py)."""

    name: str
    memory_gb: float  # usable device memory, GB (10^9 bytes)
    peak_tflops: dict[str, float]  # dense spec peak by dtype: "bf16", "fp16", "fp32"
    intra_node_gbps: float  # NVLink
    inter_node_gbps: float  # InfiniBand NIC per GPU
    hbm_gbps: float  # device-memory bandwidth
    gemm_tflops: dict[str, float] = field(default_factory=dict)  # measured best large-shape matmul (MAMF)
    sms: int | None = None  # streaming multiprocessors (wave quantisation); None: no waves (CPU)
    flash_share: float = 0.5  # flash attention forward + backward, share of the dense spec peak
    context_gb: float = 0.0  # the CUDA context and loaded kernels per process (planning/headroom.py)
    memory_share: float = 0.90  # achievable share of hbm_gbps (copy / triad kernels)
    sustained_share: float = 1.0  # of the GEMM and attention figures, sustained over training steps (calibrated)
    # a ring collective's latency in microseconds (base, per step inside a node, per step across nodes): NCCL's
    # own cost model (src/graph/tuning.cc, ring algorithm, Simple protocol); None: not modelled (gloo)
    ring_latency_us: tuple[float, float, float] | None = (8.4, 3.4, 9.6)
    # the same for a FlashAttention-2-class kernel (Ampere instructions: PyTorch SDPA's flash backend, the
    # 2023 Triton kernel), what a run without Transformer Engine's fused attention gets; None: flash_share
    fa2_share: float | None = None
    # eager kernels' costs beyond their bytes (planning/eager.py), given on the cpu preset only: an operator
    # call's overhead, forward + backward, in microseconds; dropout's keep-mask pace (bernoulli_), billions of
    # elements per second; whether unfused attention's every pass over its scores is timed; an elementwise
    # kernel's bandwidth (GB/s read + written), the memory-bound work's where it is below the copy's. None /
    # False: not modelled (a GPU's launches overlap its kernels, its masks are drawn inside fused kernels)
    op_overhead_us: float | None = None
    mask_gelems_per_s: float | None = None
    eager_score_passes: bool = False
    elementwise_gbps: float | None = None


FP32_SHARE = 0.80  # achievable share of the fp32 (non-tensor-core) spec peak: an assumption, docs/planning.md
CONTEXT_GB = 0.5  # CUDA context + cuBLAS/cuDNN/NCCL kernels per process on A100/H100-class parts (headroom.py)


def _gpu(name: str, mem: float, bf16: float, fp32: float, nvlink: float, net: float, hbm: float, mamf: float,
         sms: int, flash: tuple[float, float | None], sustained: float) -> GPUSpec:
    """``flash``: the shares of the best fused attention kernel and of a FlashAttention-2-class one."""
    return GPUSpec(name, mem, {"bf16": bf16, "fp16": bf16, "fp32": fp32}, nvlink, net, hbm,
                   {"bf16": mamf, "fp16": mamf, "fp32": FP32_SHARE * fp32}, sms, flash[0], CONTEXT_GB,
                   sustained_share=sustained, fa2_share=flash[1])


# Sources: the vendor's data sheets (SXM parts, dense = without structured sparsity; HBM bandwidth as
# listed: 2.0, 3.35, 4.8 and 8 TB/s; SMs 108, 132, 132, 148); NVLink figures are the total bidirectional
# NVLink bandwidth halved; inter-node is one NIC per GPU (HDR 200 Gb/s on A100 systems, NDR 400 Gb/s on
# H100/H200/B200 systems). Achievable GEMM peak (bf16): the "Maximum Achievable Matmul FLOPS" table of the
# "Machine Learning Engineering" open book (A100 SXM 267.9, H100 SXM 792.1 -- H200 has the same chip --,
# B200 1745.0). Flash attention shares: FlashAttention-2 (arXiv 2307.08691) on A100, FlashAttention-3
# (arXiv 2407.08608) on H100 for Transformer Engine's fused attention; FlashAttention-2 on H100 from the
# same paper (its forward 370 against FlashAttention-3's 640 TFLOP/s at head dim 128, its backward 1/1.5 to
# 1/1.75 of FlashAttention-3's: about 0.6 of the FlashAttention-3 share), B200 assumed as H100. The cpu
# preset: this machine, measured by bench/measure_cpu.py (bench/README.md, "The planner on this machine").
# The sustained shares are calibrated on the seen published runs by tests/planning_rows/calibration.py (A100 on its
# A100 rows, H100 on its H100 rows; H200 and B200 take H100's: the same chip, and no B200 rows), the one
# constant taken from throughput rows; 1.0 on the cpu preset, which has no such rows. docs/planning.md lists them all.
SUSTAINED = {"a100-80g": 0.844, "h100-sxm": 0.767}
FA2_H100 = 0.30  # a FlashAttention-2-class kernel on Hopper (and, assumed, Blackwell): 0.6 of FlashAttention-3's 0.50
AMPERE_FLASH, HOPPER_FLASH = (0.60, None), (0.50, FA2_H100)
BORROWED = {"h200": "h100-sxm", "b200": "h100-sxm"}  # same chip (H200); no calibration rows (B200): assumed
GPUS: dict[str, GPUSpec] = {
    "a100-80g": _gpu("a100-80g", 80.0, 312.0, 19.5, 300.0, 25.0, 2039.0, 267.9, 108, AMPERE_FLASH,
                     SUSTAINED["a100-80g"]),
    "h100-sxm": _gpu("h100-sxm", 80.0, 989.0, 67.0, 450.0, 50.0, 3350.0, 792.1, 132, HOPPER_FLASH,
                     SUSTAINED["h100-sxm"]),
    "h200": _gpu("h200", 141.0, 989.0, 67.0, 450.0, 50.0, 4800.0, 792.1, 132, HOPPER_FLASH,
                 SUSTAINED[BORROWED["h200"]]),
    "b200": _gpu("b200", 180.0, 2250.0, 75.0, 900.0, 50.0, 8000.0, 1745.0, 148, HOPPER_FLASH,
                 SUSTAINED[BORROWED["b200"]]),
    "cpu": GPUSpec("cpu", CPU_MEMORY_GB, {"bf16": CPU_BF16_TFLOPS, "fp16": CPU_BF16_TFLOPS, "fp32": CPU_FP32_TFLOPS},
                   CPU_GLOO_GBPS, CPU_GLOO_GBPS, CPU_MEMORY_GBPS,
                   {"bf16": CPU_BF16_TFLOPS, "fp16": CPU_BF16_TFLOPS, "fp32": CPU_FP32_TFLOPS}, None, 0.0, 0.0, 1.0,
                   ring_latency_us=None, op_overhead_us=CPU_OP_US, mask_gelems_per_s=CPU_MASK_GELEMS,
                   eager_score_passes=True, elementwise_gbps=CPU_ELEMENTWISE_GBPS),
}


@dataclass(kw_only=True)
class ClusterConfig:
    """Cluster: nodes, GPUs per node and the GPU's figures (a preset, each figure overridable)."""

    num_nodes: int = option(1, help="Nodes of the cluster the plan is for.", domain=size(MAX_RANKS))
    gpus_per_node: int = option(8, help="GPUs (ranks) per node; ranks fill nodes in order.",
                               domain=size(MAX_RANKS))
    gpu: str = option("h100-sxm", help="GPU preset: its memory, dense peak TFLOP/s and NVLink / network "
                      "bandwidth (public spec-sheet figures, docs/planning.md).", choices=sorted(GPUS))
    gpu_memory_gb: float | None = option(None, help="Device memory per GPU in GB (overrides the preset).",
                                         domain=positive(MAX_FIGURE))
    peak_tflops: float | None = option(None, help="Dense peak TFLOP/s in the run's dtype (overrides the preset).",
                                       domain=positive(MAX_FIGURE))
    intra_node_gbps: float | None = option(
        None, help="Intra-node bandwidth per GPU, one direction, in GB/s (gigabytes; overrides the preset).",
        domain=positive(MAX_FIGURE))
    inter_node_gbps: float | None = option(
        None, help="Inter-node bandwidth per GPU, one direction, in GB/s (gigabytes; overrides the preset).",
        domain=positive(MAX_FIGURE))
    hbm_gbps: float | None = option(None, help="Device-memory bandwidth in GB/s (overrides the preset).",
                                    domain=positive(MAX_FIGURE))
    sustained_share: float | None = option(
        None, help="Share of the achievable GEMM and flash-attention figures a training step sustains (clocks "
        "under load, gaps between kernels, SMs taken by overlapped communication); overrides the preset's "
        "value, calibrated on named published runs (docs/planning.md).", domain=fraction(lo_open=True))
    gemm_tflops: float | None = option(
        None, help="Achievable TFLOP/s of a large GEMM in the run's dtype (overrides the preset's measured "
        "best-shape figure; each GEMM's own shape then sets its share of it, and the sustained share scales it "
        "as it does the preset's: give --sustained-share 1 for a figure measured under training, docs/planning.md).",
        domain=positive(MAX_FIGURE))
    model_tp_comm_overlap: bool = option(
        False, help="Plan TP communication as hidden behind the layer's GEMMs (the excess exposed), as "
        "Megatron's --tp-comm-overlap runs it; megalite overlaps none, so leave off for its own runs.")
    model_te_layers: bool = option(
        False, help="Plan activation memory as Megatron-Core's Transformer Engine layers keep it (the norm "
        "fused into the next GEMM, the attention output shared with the projection's input, a fused SwiGLU), "
        "for runs made with them; megalite's eager layer keeps more, so leave off for its own runs.")
    memory_headroom_gb: float = option(
        4.0, help="GB per device --search keeps free beyond the estimate (CUDA context, NCCL buffers and "
        "fragmentation included in the estimate): layouts within it are marked and not ranked.",
        domain=at_least(0.0, MAX_FIGURE))
    moe_imbalance: float = option(
        1.0, help="Assumed max/mean of the routed rows an expert rank computes (1.0: balanced routing); "
        "scales the expert GEMMs and the token dispatch, and the report shows it.", domain=at_least(1.0, 1e3))
    comm_efficiency: float = option(
        0.75, help="Fraction of the link bandwidth a collective achieves (the NCCL bus bandwidth of large "
        "messages is about this share of the spec figure).", domain=fraction(lo_open=True))

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def spec(self) -> GPUSpec:
        return GPUS[self.gpu]

    def memory_bytes(self) -> float:
        return (self.gpu_memory_gb if self.gpu_memory_gb is not None else self.spec().memory_gb) * 1e9

    def peak_flops(self, dtype: str) -> float:
        return (self.peak_tflops if self.peak_tflops is not None else self.spec().peak_tflops[dtype]) * 1e12

    def gemm_flops(self, dtype: str) -> float:
        """The achievable peak of a large, well-shaped GEMM (the preset's measured figure, scaled with an
        overridden --peak-tflops)."""
        if self.gemm_tflops is not None:
            return self.gemm_tflops * 1e12 * self.sustained()
        s = self.spec()
        return s.gemm_tflops[dtype] / s.peak_tflops[dtype] * self.peak_flops(dtype) * self.sustained()

    def sustained(self) -> float:
        """The share of the GEMM and attention figures a training step sustains (--sustained-share or the
        preset's calibrated value)."""
        return self.sustained_share if self.sustained_share is not None else self.spec().sustained_share

    def hbm_bytes_per_s(self) -> float:
        """Achievable device-memory bandwidth: the figure times the share copy kernels reach."""
        gbps = self.hbm_gbps if self.hbm_gbps is not None else self.spec().hbm_gbps
        return gbps * 1e9 * self.spec().memory_share

    def elementwise_bytes_per_s(self) -> float:
        """The memory-bound work's bandwidth: the achievable device-memory bandwidth, or the spec's measured
        elementwise kernel's where that is slower (a CPU's GeLU computes more per byte than a copy)."""
        gbps = self.spec().elementwise_gbps
        return min(self.hbm_bytes_per_s(), gbps * 1e9) if gbps is not None else self.hbm_bytes_per_s()

    def link_bytes_per_s(self, inter_node: bool) -> float:
        s = self.spec()
        gbps = (self.inter_node_gbps if self.inter_node_gbps is not None else s.inter_node_gbps) if inter_node \
            else (self.intra_node_gbps if self.intra_node_gbps is not None else s.intra_node_gbps)
        return gbps * 1e9 * self.comm_efficiency


def cluster_errors(c: ClusterConfig) -> list[str]:
    """Bad cluster flags, each naming the flag and the rule (their declared domains)."""
    return domain_errors(c)
