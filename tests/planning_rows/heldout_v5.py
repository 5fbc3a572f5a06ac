"""Round 5 of the planner's held-out validation (docs/planning.md, "Held-out validation, round 5"): the 26 rows
of docs/heldout_v5_rows.md's main table, chosen there by a rule committed before their figures were read,
entered here before any prediction for them was computed, with that file's settings and assumptions and the
protocol's rules. Compared by step time (the file's derived step), so each source's FLOP convention cancels.

FP: FlagPerf's Megatron-Core (core_v0.6.0) cases, Transformer Engine layers; Megatron's defaults where the
stored script passes nothing (learned positions, tied embedding, biases, dropout 0.1), the distributed
optimizer without DP overlap, selective recomputation (the README's ``recompute-activations``), sequence
parallel where TP > 1; A800 as the A100 preset with NVLink 200 GB/s and 200 Gb/s per GPU across nodes.
FMS: IBM's fms-fsdp (PyTorch FSDP FULL_SHARD with prefetch, bf16 reduction, SDPA flash attention), one
micro-batch of 2 per step; its column headings' network figures are per node (400 / 800 Gb/s over 8 GPUs).
IE: InternEvo's 7B FLOPS tests (ZeRO-1 as the distributed optimizer, gradient reduction overlapped, flash
attention; 4 x 100 Gb/s RoCE per node).
"""

from __future__ import annotations

from tests.planning_rows.heldout import _NO_DROPOUT, HeldOutRun, _layout, _llama, _nodes

_FP = "FlagPerf training/nvidia/{llama3_8B,llama3_70B,mixtral_8x7B}-megatron/README.md (github.com/FlagOpen/FlagPerf)"
_FMS = "IBM fms-fsdp README.md, Training throughput benchmarks (github.com/foundation-model-stack/fms-fsdp)"
_IE = "InternEvo doc/en/train_performance.md, FLOPS Testing (github.com/InternLM/InternEvo)"
_A800 = ("--intra-node-gbps", "200", "--inter-node-gbps", "25", "--model-te-layers")


def _fp_model(h: int, heads: int, groups: int, ffn: int, seq: int) -> tuple[str, ...]:
    """Llama 3's shape as FlagPerf's script passes it; what it does not pass keeps Megatron's defaults."""
    return ("--hidden-size", str(h), "--num-attention-heads", str(heads), "--group-query-attention",
            "--num-query-groups", str(groups), "--ffn-hidden-size", str(ffn), "--swiglu", "--normalization",
            "RMSNorm", "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--vocab-size", "128255",
            "--make-vocab-size-divisible-by", "128")


def _fp(id: str, model: tuple[str, ...], layers: int, tp: int, pp: int, gpus: int, batch: int, step_s: float,
        tflops: float, gpu: str = "h100-sxm", mbs: int = 1, *extra: str) -> HeldOutRun:
    sp = ("--sequence-parallel",) if tp > 1 else ()
    layout = _layout(tp, pp, batch, "--bf16", *sp, "--use-distributed-optimizer", "--recompute-granularity",
                     "selective", *extra, mbs=mbs)
    cluster = _nodes(gpus, gpu, *(_A800 if gpu == "a100-80g" else ("--model-te-layers",)))
    return HeldOutRun(id, _FP, model, layout, cluster, layers, tflops, False, step_s=step_s)


_L3_8B = _fp_model(4096, 32, 8, 14336, 8192)
_MIXTRAL = (*_llama(4096, 32, 8, 14336, 32000, 4096), "--num-experts", "8", "--moe-router-topk", "2",
            "--moe-ffn-hidden-size", "14336", "--moe-token-dispatcher-type", "allgather", "--moe-grouped-gemm")
_A = "a100-80g"


def _fms(id: str, size: str, gpu: str, step_s: float, tflops: float) -> HeldOutRun:
    """An fms-fsdp row: ZeRO-3 over all GPUs, both overlaps (FSDP prefetches), bf16 reduction, one micro-batch
    of 2 per step, no dropout; recomputation as the rows file infers it (13B: a third of the blocks)."""
    layers, model, recompute = {
        "13b": (40, _llama(5120, 40, 40, 13824, 32000, 4096),
                ("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "13")),
        "34b": (48, _llama(8192, 64, 8, 22016, 32000, 4096), ("--recompute-granularity", "full")),
        "70b": (80, _llama(8192, 64, 8, 28672, 32000, 4096), ("--recompute-granularity", "full"))}[size]
    gpus, per_gpu_gbps = (128, "6.25") if gpu == _A else (96, "12.5")
    layout = _layout(1, 1, 2 * gpus, "--bf16", "--data-parallel-sharding-strategy", "optim_grads_params",
                     "--overlap-grad-reduce", "--overlap-param-gather", "--grad-reduce-in-bf16", *recompute, mbs=2)
    return HeldOutRun(id, _FMS, (*model, *_NO_DROPOUT), layout, _nodes(gpus, gpu, "--inter-node-gbps", per_gpu_gbps),
                      layers, tflops, False, step_s=step_s)


def _ie(id: str, gpus: int, mbs: int, micro: int, ac: bool, step_s: float, tflops: float) -> HeldOutRun:
    """An InternEvo 7B row: TP1, ZeRO-1 as the distributed optimizer, gradient reduction overlapped."""
    model = (*_llama(4096, 32, 32, 11008, 103168, 2048), *_NO_DROPOUT)
    recompute = ("--recompute-granularity", "full") if ac else ()
    layout = _layout(1, 1, gpus * mbs * micro, "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
                     *recompute, mbs=mbs)
    return HeldOutRun(id, _IE, model, layout, _nodes(gpus, _A, "--inter-node-gbps", "6.25"), 32, tflops, ac,
                      step_s=step_s)


HELD_OUT_V5: list[HeldOutRun] = [
    _fp("FP-A-8B-8", _L3_8B, 32, 1, 2, 8, 512, 141.7, 177.5, _A),
    _fp("FP-A-8B-8-PP4DP2", _L3_8B, 32, 1, 4, 8, 512, 158.6, 158.7, _A),
    _fp("FP-A-8B-8-PP2DP2TP2", _L3_8B, 32, 2, 2, 8, 512, 153.8, 163.6, _A),
    _fp("FP-A-8B-8-PP2TP4", _L3_8B, 32, 4, 2, 8, 512, 174.4, 144.3, _A),
    _fp("FP-A-8B-8-PP8", _L3_8B, 32, 1, 8, 8, 512, 194.9, 129.1, _A),
    _fp("FP-A-8B-8-TP8", _L3_8B, 32, 8, 1, 8, 512, 213.9, 117.7, _A),
    _fp("FP-A-8B-8-PP4TP2", _L3_8B, 32, 2, 4, 8, 512, 172.3, 146.0, _A),
    _fp("FP-H-8B-8", _L3_8B, 32, 2, 1, 8, 512, 64.70, 388.9),
    _fp("FP-H-8B-16", _L3_8B, 32, 2, 1, 16, 512, 33.12, 379.9),
    _fp("FP-H-8B-440", _L3_8B, 32, 2, 1, 440, 1760, 4.650, 338.3),
    _fp("FP-H-70B-64", _fp_model(8192, 64, 8, 28672, 8192), 80, 8, 4, 64, 512, 77.01, 357.4),
    _fp("FP-H-MIX-32", _MIXTRAL, 32, 8, 2, 32, 1200, 54.01, 216.7, "h100-sxm", 3, "--expert-model-parallel-size",
        "1", "--expert-tensor-parallel-size", "8"),
    _fms("FMS-A-13B-128", "13b", _A, 3.810, 189.5),
    _fms("FMS-A-34B-128", "34b", _A, 9.990, 181.9),
    _fms("FMS-A-70B-128", "70b", _A, 19.98, 182.9),
    _fms("FMS-H-13B-96", "13b", "h100-sxm", 1.689, 427.6),
    _fms("FMS-H-34B-96", "34b", "h100-sxm", 4.477, 405.9),
    _fms("FMS-H-70B-96", "70b", "h100-sxm", 9.204, 397.0),
    _ie("IE-AC-8", 8, 8, 1, True, 4.944, 193.0),
    _ie("IE-AC-64", 64, 8, 1, True, 5.093, 188.0),
    _ie("IE-AC-1024", 1024, 8, 1, True, 5.180, 184.0),
    _ie("IE-AC-1024-4M", 1024, 2, 1, True, 1.750, 136.0),
    _ie("IE-NOAC-8", 8, 2, 4, False, 3.993, 183.0),
    _ie("IE-NOAC-64", 64, 2, 4, False, 4.154, 174.0),
    _ie("IE-NOAC-1024", 1024, 2, 4, False, 4.520, 160.0),
    _ie("IE-NOAC-1024-4M", 1024, 2, 1, False, 1.746, 105.0),
]
