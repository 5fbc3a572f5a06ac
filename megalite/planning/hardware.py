"""The cluster a plan is for: GPU presets (public spec-sheet figures) and the --num-nodes ... flags."""

from __future__ import annotations

from dataclasses import dataclass

from megalite.config.domain import MAX_RANKS, fraction, positive, size
from megalite.config.flags import domain_errors, option

MAX_FIGURE = 1e9  # TFLOP/s, GB or GB/s per GPU: a figure past this is a typo


@dataclass(frozen=True)
class GPUSpec:
    """One GPU's public figures. Bandwidths are GB/s per GPU in one direction."""

    name: str
    memory_gb: float  # usable device memory, GB (10^9 bytes)
    peak_tflops: dict[str, float]  # dense peak by dtype: "bf16", "fp16", "fp32"
    intra_node_gbps: float  # NVLink
    inter_node_gbps: float  # InfiniBand NIC per GPU
    hbm_gbps: float  # device-memory bandwidth


# Sources: the vendor's data sheets (SXM parts, dense = without structured sparsity; HBM bandwidth as
# listed: 2.0, 3.35, 4.8 and 8 TB/s); NVLink figures are
# the total bidirectional NVLink bandwidth halved; inter-node is one NIC per GPU (HDR 200 Gb/s on A100
# systems, NDR 400 Gb/s on H100/H200/B200 systems). docs/planning.md lists them.
GPUS: dict[str, GPUSpec] = {
    "a100-80g": GPUSpec("a100-80g", 80.0, {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}, 300.0, 25.0, 2039.0),
    "h100-sxm": GPUSpec("h100-sxm", 80.0, {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}, 450.0, 50.0, 3350.0),
    "h200": GPUSpec("h200", 141.0, {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}, 450.0, 50.0, 4800.0),
    "b200": GPUSpec("b200", 180.0, {"bf16": 2250.0, "fp16": 2250.0, "fp32": 75.0}, 900.0, 50.0, 8000.0),
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
    compute_efficiency: float = option(
        0.62, help="Fraction of the dense peak the model's FLOPs run at (GEMMs plus everything else that "
        "is not communication or pipeline bubble); fitted to the published runs in docs/planning.md.",
        domain=fraction(lo_open=True))
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

    def hbm_bytes_per_s(self) -> float:
        return (self.hbm_gbps if self.hbm_gbps is not None else self.spec().hbm_gbps) * 1e9

    def link_bytes_per_s(self, inter_node: bool) -> float:
        s = self.spec()
        gbps = (self.inter_node_gbps if self.inter_node_gbps is not None else s.inter_node_gbps) if inter_node \
            else (self.intra_node_gbps if self.intra_node_gbps is not None else s.intra_node_gbps)
        return gbps * 1e9 * self.comm_efficiency


def cluster_errors(c: ClusterConfig) -> list[str]:
    """Bad cluster flags, each naming the flag and the rule (their declared domains)."""
    return domain_errors(c)
