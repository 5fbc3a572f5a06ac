"""What a device holds besides the run's tensors (docs/planning.md, "Headroom"): the CUDA context, the
communication library's buffers and the caching allocator's fragmentation. Added to the plan's memory
report (not to the start-up memory check, whose CPU ranks have none of them).

- CUDA context: the driver context plus the kernels PyTorch, cuBLAS, cuDNN and NCCL load, per process;
  about 0.5 GB on A100/H100-class parts with CUDA's lazy module loading (the default since CUDA 12.2).
  hardware.py's CONTEXT_GB; 0 for the cpu preset.
- NCCL buffers, per communicator the rank belongs to (a group of more than one rank): each channel's
  receive buffers for the three protocols, Simple (NCCL_BUFFSIZE, 4 MiB by default), LL128 (about
  4.6 MiB) and LL (256 KiB), for 16 channels (NCCL's usual count on NVLink systems): about 142 MiB.
  None with gloo (the cpu preset).
- Fragmentation: the caching allocator rounds blocks up and splits its 2 MiB / 20 MiB segments; the
  persistent state lives in a few large flat buffers, the transient tensors (activations, communication
  and dispatch buffers) fragment: an allowance of 10% of those. An assumption, not a measurement.
"""

from __future__ import annotations

from megalite.planning.hardware import ClusterConfig
from megalite.planning.model_shape import EXPERT_FAMILY
from megalite.planning.shape import RunShape

MIB = 2**20
NCCL_CHANNELS = 16
NCCL_CHANNEL_BYTES = 4 * MIB + int(4.6 * MIB) + 256 * 1024  # Simple + LL128 + LL receive buffers
FRAGMENTATION = 0.10
TRANSIENT_TERMS = ("activations", "communication buffers", "MoE activations", "MoE dispatch buffers")


def communicators(sh: RunShape) -> int:
    """Process groups of more than one rank this rank communicates in (TP, CP, DP x CP, PP, the
    embedding pair, EP, expert-TP, expert-DP)."""
    sizes = [sh.tp, sh.cp, sh.dp * sh.cp, sh.pp, 2 if sh.pp > 1 and sh.cfg.model.tied_embeddings else 1]
    if EXPERT_FAMILY in sh.families:  # the expert family's groups
        sizes += [sh.ep, sh.etp, sh.edp]
    return sum(1 for n in sizes if n > 1)


def overhead_terms(sh: RunShape, cl: ClusterConfig, terms: dict[str, float]) -> dict[str, float]:
    """The report's lines besides the tensors: CUDA context, NCCL buffers, allocator fragmentation."""
    spec = cl.spec()
    nccl = 0.0 if spec.name == "cpu" else communicators(sh) * NCCL_CHANNELS * NCCL_CHANNEL_BYTES
    transient = sum(terms.get(name, 0.0) for name in TRANSIENT_TERMS)
    return {"CUDA context": spec.context_gb * 1e9, "NCCL buffers": nccl,
            "allocator fragmentation": FRAGMENTATION * transient}
