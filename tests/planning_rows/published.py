"""Published training runs the time model is checked against (data, with their source; the
comparison is in docs/planning.md and tests/test_planning.py).

Table 1 of "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
(Narayanan et al., 2021): GPT models on A100-80GB (DGX A100 nodes of 8, 200 Gb/s HDR InfiniBand per
GPU), sequence 2048, vocabulary 51,200, fp16, full activation recomputation; TFLOP/s per GPU counts the
recomputation's extra forward. And the H100 weak-scaling table of the Megatron-LM README: vocabulary
131,072, sequence 4,096, bf16, gradient reduction and parameter gather overlapped, model FLOPs (MFU's
count). Neither gives the micro-batch size, the schedule or the recomputation of each row; the
assumptions the planner runs them with are the fields below and docs/planning.md states them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PublishedRun:
    source: str
    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float  # as published
    gpu: str
    seq: int
    vocab: int
    dtype: str  # "fp16" or "bf16"
    recompute: str | None  # assumed
    counts_recompute: bool  # the published TFLOP/s include the recomputed forward
    distributed_optimizer: bool
    overlap: bool  # --overlap-grad-reduce / --overlap-param-gather

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


_TABLE1 = "Narayanan et al. 2021, Table 1"
_H100 = "Megatron-LM README, H100 weak scaling"


def _a100(name: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
          tflops: float) -> PublishedRun:
    return PublishedRun(_TABLE1, name, heads, hidden, layers, tp, pp, gpus, batch, tflops, "a100-80g", 2048,
                        51200, "fp16", "full", True, False, False)


def _h100(name: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
          tflops: float) -> PublishedRun:
    return PublishedRun(_H100, name, heads, hidden, layers, tp, pp, gpus, batch, tflops, "h100-sxm", 4096,
                        131072, "bf16", "selective", False, True, True)


PUBLISHED: list[PublishedRun] = [
    _a100("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    _a100("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    _a100("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    _a100("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    _a100("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    _a100("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _a100("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _a100("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _a100("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    _a100("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
    _h100("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    _h100("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
    _h100("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1),
    _h100("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
    _h100("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7),
    _h100("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    _h100("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    _h100("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    _h100("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
]


def run_flags(run: PublishedRun) -> list[str]:
    """pretrain_gpt.py flags of a published run (micro-batch 1, 1F1B)."""
    flags = ["--num-layers", str(run.layers), "--hidden-size", str(run.hidden), "--num-attention-heads",
             str(run.heads), "--seq-length", str(run.seq), "--max-position-embeddings", str(run.seq),
             "--micro-batch-size", "1", "--global-batch-size", str(run.batch),
             "--tensor-model-parallel-size", str(run.tp), "--pipeline-model-parallel-size", str(run.pp),
             f"--{run.dtype}", "--vocab-size", str(run.vocab - 1), "--make-vocab-size-divisible-by", "128"]
    if run.recompute:
        flags += ["--recompute-granularity", run.recompute]
    if run.distributed_optimizer:
        flags.append("--use-distributed-optimizer")
    if run.overlap:
        flags += ["--overlap-grad-reduce", "--overlap-param-gather"]
    if run.tp > 1:
        flags.append("--sequence-parallel") if run.source == _H100 else None
    return flags


def cluster_flags(run: PublishedRun) -> list[str]:
    """The cluster; the README's H100 runs overlapped TP communication (--tp-comm-overlap)."""
    overlap = ["--model-tp-comm-overlap"] if run.source == _H100 else []
    return ["--num-nodes", str(run.gpus // 8), "--gpus-per-node", "8", "--gpu", run.gpu, *overlap]


@dataclass(frozen=True)
class PublishedMoE:
    """A mixture-of-experts model's published parameter counts (total and active per token), the sanity
    row of the planner's MoE parameter count; the architecture is the model's released configuration."""

    source: str
    name: str
    flags: tuple[str, ...]  # pretrain_gpt.py model flags
    total_b: float  # billions, as published
    active_b: float
    whole_billions: bool = False  # published as whole billions, cut off (not rounded): 37.55 B is "37B"

    def agrees(self, planned: float, published: float) -> bool:
        """The planner's count (parameters) to the published figure's precision."""
        b = planned / 1e9
        return int(b) == published if self.whole_billions else round(b, 1) == published


_MIXTRAL = ("Mixtral of experts, Mistral AI announcement (December 2023): 46.7B total, 12.9B per token; "
            "architecture: the released Mixtral-8x7B configuration")
_QWEN_MOE = ("Qwen1.5-MoE-A2.7B model card: 14.3B total, 2.7B activated; architecture: its released "
             "configuration")
_DEEPSEEK_V3 = ("DeepSeek-V3 technical report (arXiv 2412.19437): 671B total, 37B activated per token, the "
                "multi-token prediction module apart; architecture: its released configuration (61 layers, the "
                "first 3 dense; MLA; 256 routed experts in 8 groups, top-8 from 4 groups, 1 shared expert)")
_LLAMA_STYLE = ("--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--make-vocab-size-divisible-by",
                "128")

PUBLISHED_MOE: list[PublishedMoE] = [
    PublishedMoE(_MIXTRAL, "Mixtral-8x7B", (
        "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--group-query-attention",
        "--num-query-groups", "8", "--ffn-hidden-size", "14336", "--num-experts", "8", "--moe-router-topk", "2",
        "--vocab-size", "31999", *_LLAMA_STYLE), 46.7, 12.9),
    PublishedMoE(_QWEN_MOE, "Qwen1.5-MoE-A2.7B", (
        "--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--add-qkv-bias",
        "--moe-ffn-hidden-size", "1408", "--num-experts", "60", "--moe-router-topk", "4",
        "--moe-shared-expert-intermediate-size", "5632", "--moe-shared-expert-gate", "--vocab-size", "151935",
        *_LLAMA_STYLE), 14.3, 2.7),
    PublishedMoE(_DEEPSEEK_V3, "DeepSeek-V3", (
        "--num-layers", "61", "--hidden-size", "7168", "--num-attention-heads", "128", "--ffn-hidden-size", "18432",
        "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", "1536", "--kv-lora-rank", "512", "--qk-head-dim",
        "128",
        "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128", "--position-embedding-type", "yarn",
        "--rotary-scaling-factor", "40", "--yarn-original-max-position-embeddings", "4096", "--mscale", "1.0",
        "--mscale-all-dim", "1.0", "--num-experts", "256", "--moe-ffn-hidden-size", "2048", "--moe-router-topk", "8",
        "--moe-shared-expert-intermediate-size", "2048", "--moe-layer-freq", "([0]*3+[1]*58)",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-num-groups", "8",
        "--moe-router-group-topk", "4", "--moe-router-topk-scaling-factor", "2.5", "--vocab-size", "129279",
        *(f for f in _LLAMA_STYLE if f not in ("--position-embedding-type", "rope"))), 671, 37, whole_billions=True),
]
