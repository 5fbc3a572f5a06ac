"""Compute time of one layer on one rank, GEMM by GEMM (docs/planning.md, "Step time").

Each GEMM C[m, n] = A[m, k] B[k, n] runs at the device's achievable large-GEMM peak (its measured
best-shape figure, hardware.py) times its own tile and wave quantisation: the output is cut into
128 x 256 tiles, the tiles run in waves of one per SM, and a partly filled tile or wave costs as much as
a full one (arXiv 2401.14489). A GEMM whose operands and output take longer to move than its FLOPs take
to run is bound by memory bandwidth (the roofline). Backward is two GEMMs per forward GEMM, each with
its own shape: dA[m, k] = dC B^T and dB[k, n] = A^T dC. Flash attention runs at its own published
share of the peak; unfused attention is two batched GEMMs per head (its softmax and dropout are
memory-bound work, timing.py).
"""

from __future__ import annotations

import math

from megalite.planning import mla
from megalite.planning.hardware import ClusterConfig
from megalite.planning.model_shape import DENSE_LAYER, LayerShape
from megalite.planning.moe import expert_rows, routed_tokens
from megalite.planning.shape import RunShape

TILE_M, TILE_N = 128, 256  # the largest common bf16 output tile of cuBLAS/CUTLASS kernels on SM80/SM90
UNFUSED_BACKENDS = ("unfused", "local")
FLASH_BACKWARD = 2.5  # flash attention's backward does 2.5x its forward's FLOPs (the FlashAttention-2 count)


def wave_efficiency(m: int, n: int, batch: int, sms: int | None) -> float:
    """Share of the SMs' tile slots doing useful work: useful output elements over the elements of the
    tiles in the waves the GEMM takes (1 with no SMs, a CPU)."""
    if sms is None:
        return 1.0
    tiles = batch * math.ceil(m / TILE_M) * math.ceil(n / TILE_N)
    waves = math.ceil(tiles / sms)
    return batch * m * n / (waves * sms * TILE_M * TILE_N)


def gemm_s(m: float, n: float, k: float, cl: ClusterConfig, dtype: str, elem: int, batch: int = 1) -> float:
    """One (batched) GEMM: the slower of its FLOPs at the quantised achievable peak and its bytes
    (operands read once, output written once) at the achievable memory bandwidth."""
    m, n, k = max(int(m), 1), max(int(n), 1), max(int(k), 1)
    flops = 2.0 * batch * m * n * k
    compute = flops / (cl.gemm_flops(dtype) * wave_efficiency(m, n, batch, cl.spec().sms))
    memory = batch * (m * k + k * n + m * n) * elem / cl.hbm_bytes_per_s()
    return max(compute, memory)


def train_gemm_s(m: float, n: float, k: float, cl: ClusterConfig, dtype: str, elem: int, batch: int = 1,
                 forwards: float = 1) -> float:
    """A GEMM's forward (``forwards`` times: 2 with full recomputation) and its two backward GEMMs."""
    fwd = gemm_s(m, n, k, cl, dtype, elem, batch)
    return forwards * fwd + gemm_s(m, k, n, cl, dtype, elem, batch) + gemm_s(k, n, m, cl, dtype, elem, batch)


def _forwards(sh: RunShape) -> float:
    """Forwards per layer: 1, and again for the share of layers full recomputation reruns."""
    return 1 + sh.recomputed_share


def linear_s(sh: RunShape, cl: ClusterConfig, layer: LayerShape = DENSE_LAYER) -> float:
    """A layer's linear GEMMs (QKV, projection, and the MLP of a dense layer; an MoE layer's experts are
    ``moe_mlp_s``) per micro-batch, forward and backward, on one rank: tokens b·s/c, output features split
    over TP."""
    m, t, h, T = sh.cfg.model, sh.tp, sh.h, sh.local_tokens
    a, g, d, f = m.num_attention_heads, m.num_query_groups, m.kv_channels, m.ffn_hidden_size
    args = (cl, sh.dtype, sh.act_bytes)
    kw = {"forwards": _forwards(sh)}
    out = train_gemm_s(T, (a + 2 * g) * d / t, h, *args, **kw) + train_gemm_s(T, h, a * d / t, *args, **kw)
    if m.multi_latent_attention:  # its projections' multiply-adds on this rank (planning/mla.py)
        out = train_gemm_s(T, mla.rank_gemm_macs(m, t, sh.sp) / h, h, *args, **kw)
    if not layer.moe:
        out += mlp_s(sh, cl, T, f / t)
    return out


def mlp_s(sh: RunShape, cl: ClusterConfig, rows: float, ffn: float, batch: int = 1) -> float:
    """An MLP of hidden size ``ffn`` (per rank) on ``rows`` rows: fc1 (2 x ffn with SwiGLU) and fc2."""
    args = (cl, sh.dtype, sh.act_bytes)
    fc1 = 2 * ffn if sh.cfg.model.gated_linear_unit else ffn
    kw = {"batch": batch, "forwards": _forwards(sh)}
    return train_gemm_s(rows, fc1, sh.h, *args, **kw) + train_gemm_s(rows, sh.h, ffn, *args, **kw)


def attention_s(sh: RunShape, cl: ClusterConfig, layer: LayerShape = DENSE_LAYER) -> float:
    """The core attention per micro-batch on one rank (its a/t heads, its s/c queries against the s keys).
    Flash: the causal half of the square at the device's flash share of the spec peak, forward (again
    with selective or full recomputation) and backward; Transformer Engine's fused attention (cuDNN) runs
    at the device's best kernel's share, other layers (SDPA, Triton) at a FlashAttention-2-class kernel's.
    Unfused: QK^T and PV as batched GEMMs per head (over every key: the window is a mask there). A
    sliding-window layer's flash (blockwise) work is its band: s/c queries x the window's keys."""
    m = sh.cfg.model
    heads, d, q = m.num_attention_heads // sh.tp, m.kv_channels, sh.s // sh.cp
    if m.multi_latent_attention:  # q, k and v at the core's common width (planning/mla.py)
        d = mla.core_width(m)
    again = 1 if sh.recompute == "selective" else sh.recomputed_share
    if m.attention_backend in UNFUSED_BACKENDS or not cl.spec().flash_share:
        args = (cl, sh.dtype, sh.act_bytes)
        batch = sh.b * heads
        return (train_gemm_s(q, sh.s, d, *args, batch=batch, forwards=1 + again)
                + train_gemm_s(q, d, sh.s, *args, batch=batch, forwards=1 + again))
    keys = sh.s / 2 if layer.keys_per_query(sh.s) >= sh.s else layer.keys_per_query(sh.s)  # causal half, or band
    fwd = 2 * 2 * sh.b * heads * q * keys * d  # QK^T and PV
    spec = cl.spec()
    share = spec.flash_share if sh.te_layers or spec.fa2_share is None else spec.fa2_share
    return fwd * (1 + again + FLASH_BACKWARD) / (cl.peak_flops(sh.dtype) * share * cl.sustained())


def moe_mlp_s(sh: RunShape, cl: ClusterConfig) -> float:
    """An MoE layer's MLP per micro-batch on one rank: the router GEMM on its T tokens, its E/ep experts
    on their rows (expert_rows x the assumed max/mean imbalance: the step waits for the fullest rank),
    the shared expert on the stage's tokens."""
    m = sh.cfg.model
    local = m.num_experts // sh.ep
    rows = expert_rows(sh) * cl.moe_imbalance / local
    out = train_gemm_s(routed_tokens(sh), m.num_experts, sh.h, cl, sh.dtype, sh.act_bytes, forwards=_forwards(sh))
    out += mlp_s(sh, cl, rows, m.expert_ffn_hidden_size / sh.etp, batch=local)
    if m.moe_shared_expert_intermediate_size:
        out += mlp_s(sh, cl, sh.local_tokens, m.moe_shared_expert_intermediate_size / sh.tp)
    return out


def logits_s(sh: RunShape, cl: ClusterConfig) -> float:
    """The output layer's GEMM per micro-batch on the last stage (vocabulary split over TP); recomputation
    never reruns it."""
    return train_gemm_s(sh.local_tokens, sh.padded_vocab / sh.tp, sh.h, cl, sh.dtype, sh.act_bytes)


def stage_compute_s(sh: RunShape, cl: ClusterConfig) -> float:
    """One micro-batch through the busiest pipeline rank (``stage_paces``): the pace of every stage."""
    return max(stage_paces(sh, cl))


def stage_paces(sh: RunShape, cl: ClusterConfig) -> list[float]:
    """Each pipeline rank's compute per micro-batch: its layers (all its chunks), and the output layer on
    the rank holding the loss, even split or not (the first held-out protocol's predictions spread it over
    the stages instead, docs/planning.md; the first/last counts of an uneven split can lighten that rank)."""
    if sh.pp == 1:
        return [layers_compute_s(sh, cl, 0) + logits_s(sh, cl)]
    return [layers_compute_s(sh, cl, r) + (logits_s(sh, cl) if r == sh.loss_rank else 0.0) for r in range(sh.pp)]


def layers_compute_s(sh: RunShape, cl: ClusterConfig, stage: int) -> float:
    """One micro-batch through the transformer layers of pipeline rank ``stage`` (all its chunks)."""
    return sum(n * layer_compute_s(sh, cl, kind) for kind, n in sh.kinds_in(stage).items())


def layer_compute_s(sh: RunShape, cl: ClusterConfig, layer: LayerShape) -> float:
    """One micro-batch through one layer of kind ``layer``: its GEMMs, attention and (MoE) experts."""
    return linear_s(sh, cl, layer) + attention_s(sh, cl, layer) + (moe_mlp_s(sh, cl) if layer.moe else 0.0)
