"""Held-out published runs: rows no constant of the time model was taken from (docs/planning.md,
"Held-out validation: the protocol"). Each row is its source, its model and layout as pretrain_gpt.py
flags, its cluster as planner flags, and the published TFLOP/s per GPU; the settings a paper does not
state are the protocol's assumptions, written there before any prediction was computed.

Rows whose layers do not divide by the pipeline stages (uneven stages, not plannable yet) are planned
with ``planned_layers`` (every stage as full as the fullest, which sets the pipeline's pace) and credited
with the FLOPs of their real ``layers``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeldOutRun:
    id: str
    source: str
    model: tuple[str, ...]  # pretrain_gpt.py model flags without --num-layers
    layout: tuple[str, ...]  # layout, batch and precision flags
    cluster: tuple[str, ...]  # planner cluster flags
    layers: int  # the model's layers (its FLOPs)
    tflops_per_gpu: float  # as published
    counts_recompute: bool  # the published TFLOP/s include the recomputed forward
    bound: bool = True  # held to the protocol's bound (False: reported only, for the reason in the docs)
    planned_layers: int | None = None  # uneven stages: planned as this many (each stage as the fullest)
    step_s: float | None = None  # round 2: the published step time, compared in the source's own FLOPs count
    recompute_unstated: bool = False  # round 3: planned without, then selective, then full, until it fits

    def flags(self) -> list[str]:
        return ["--num-layers", str(self.planned_layers or self.layers), *self.model, *self.layout]


def _gpt(h: int, heads: int, seq: int, vocab: int) -> tuple[str, ...]:
    return ("--hidden-size", str(h), "--num-attention-heads", str(heads), "--seq-length", str(seq),
            "--max-position-embeddings", str(seq), "--vocab-size", str(vocab - 1), "--make-vocab-size-divisible-by",
            "128", "--attention-backend", "unfused")


def _layout(tp: int, pp: int, batch: int, *extra: str, mbs: int = 1) -> tuple[str, ...]:
    return ("--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), "--micro-batch-size",
            str(mbs), "--global-batch-size", str(batch), *extra)


def _nodes(gpus: int, gpu: str, *extra: str) -> tuple[str, ...]:
    return ("--num-nodes", str(gpus // 8), "--gpus-per-node", "8", "--gpu", gpu, *extra)


_K = "Reducing Activation Recomputation in Large Transformer Models (arXiv 2205.05198); Megatron-LM README MFU table"
_BLOOM = "BLOOM (arXiv 2211.05100) and the BigScience 176B model page"
_OPT = "OPT: Open Pre-trained Transformer Language Models (arXiv 2205.01068), section 2.4"
_MTNLG = "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B (arXiv 2201.11990)"
_LLAMA3 = "The Llama 3 Herd of Models (arXiv 2407.21783), Table 4"
_QWEN3 = "Megatron-MoE-ModelZoo, best_practice/Qwen3/readme.md (Megatron-Core, H100)"

_KSEL = ("--fp16", "--sequence-parallel", "--recompute-granularity", "selective")
_ZERO1_FULL = ("--bf16", "--use-distributed-optimizer", "--recompute-granularity", "full")
_LLAMA405 = ("--hidden-size", "16384", "--num-attention-heads", "128", "--group-query-attention", "--num-query-groups",
             "8", "--ffn-hidden-size", "53248", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
             "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--seq-length", "8192",
             "--max-position-embeddings", "8192", "--vocab-size", "128255", "--make-vocab-size-divisible-by", "128")
_L3 = ("--bf16", "--sequence-parallel", "--num-layers-per-virtual-pipeline-stage", "4",
       "--data-parallel-sharding-strategy", "optim_grads", "--overlap-grad-reduce", "--recompute-granularity",
       "selective")
_QWEN3_MODEL = ("--hidden-size", "4096", "--num-attention-heads", "64", "--kv-channels", "128",
                "--group-query-attention", "--num-query-groups", "4", "--num-experts", "128", "--moe-router-topk",
                "8", "--moe-ffn-hidden-size", "1536", "--moe-token-dispatcher-type", "alltoall", "--swiglu",
                "--normalization", "RMSNorm",
                "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
                "--seq-length", "4096", "--max-position-embeddings", "4096", "--vocab-size", "151935",
                "--make-vocab-size-divisible-by", "128")

HELD_OUT: list[HeldOutRun] = [
    HeldOutRun("K-22B", _K, _gpt(6144, 64, 2048, 51200), _layout(8, 1, 4, *_KSEL), _nodes(8, "a100-80g"),
               48, 0.415 * 312, False),
    HeldOutRun("K-175B", _K, _gpt(12288, 96, 2048, 51200), _layout(8, 8, 64, *_KSEL), _nodes(64, "a100-80g"), 96,
               0.514 * 312, False),
    HeldOutRun("K-530B", _K, _gpt(20480, 128, 2048, 51200), _layout(8, 35, 280, *_KSEL), _nodes(280, "a100-80g"),
               105, 0.560 * 312, False),
    HeldOutRun("K-1T", _K, _gpt(25600, 160, 2048, 51200), _layout(8, 64, 512, *_KSEL), _nodes(512, "a100-80g"), 128,
               0.563 * 312, False),
    HeldOutRun("BLOOM", _BLOOM, (*_gpt(14336, 112, 2048, 250680), "--position-embedding-type", "rope"),
               _layout(4, 12, 2048, *_ZERO1_FULL, mbs=2), _nodes(384, "a100-80g", "--inter-node-gbps", "6.25"), 70,
               150.0, True, planned_layers=72),
    HeldOutRun("OPT", _OPT, _gpt(12288, 96, 2048, 50272),
               _layout(8, 1, 992, "--fp16", "--data-parallel-sharding-strategy", "optim_grads_params",
                       "--overlap-grad-reduce", "--recompute-granularity", "full", mbs=8),
               _nodes(992, "a100-80g"), 96, 147.0, True),
    *[HeldOutRun(f"MTNLG-{n}", _MTNLG, _gpt(20480, 128, 2048, 51200), _layout(8, 35, 1920, *_ZERO1_FULL),
                 _nodes(8 * n, "a100-80g"), 105, tf, True) for n, tf in ((280, 126.0), (350, 121.0), (420, 113.0))],
    HeldOutRun("L3-8K", _LLAMA3, _LLAMA405, _layout(8, 16, 2048, *_L3), _nodes(8192, "h100-sxm"), 126, 430.0, False,
               planned_layers=128),
    HeldOutRun("L3-16K", _LLAMA3, _LLAMA405, _layout(8, 16, 2048, *_L3), _nodes(16384, "h100-sxm"), 126, 400.0,
               False, planned_layers=128),
]

# Round 2 (docs/planning.md, "Held-out validation, round 2"): rows gathered in docs/heldout_v2_rows.md before
# any prediction for them was computed; the assumptions written there are the settings planned. Compared by
# step time (predicted TFLOP/s = published x published step / predicted step), so each source's FLOPs
# convention cancels. DG: NVIDIA DGX Cloud benchmarking recipes (NeMo 24.09/24.11, H100, bf16); TT:
# torchtitan's docs/performance.md (64 A100-80GB, FSDP2).
_DG = "NVIDIA DGX Cloud Benchmarking recipes (github.com/NVIDIA/dgxc-benchmarking), BF16 tables"
_TT = "torchtitan docs/performance.md (github.com/pytorch/torchtitan), Llama 3 / Llama 2 tables"
_NEMO = ("--bf16", "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce",
         "--overlap-param-gather")
_FSDP = ("--bf16", "--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce")
_GPT3 = ("--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048", "--max-position-embeddings",
         "2048", "--vocab-size", "51199", "--make-vocab-size-divisible-by", "128")


def _llama(h: int, heads: int, groups: int, ffn: int, vocab: int, seq: int) -> tuple[str, ...]:
    kv = ("--group-query-attention", "--num-query-groups", str(groups)) if groups != heads else ()
    return ("--hidden-size", str(h), "--num-attention-heads", str(heads), *kv, "--ffn-hidden-size", str(ffn),
            "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--seq-length", str(seq),
            "--max-position-embeddings", str(seq), "--vocab-size", str(vocab - 1), "--make-vocab-size-divisible-by",
            "128")


def _nemotron(h: int, heads: int) -> tuple[str, ...]:
    """Nemotron-4: squared-ReLU MLP of 4h (planned as a plain 4h MLP: the same GEMMs), LayerNorm1p, RoPE."""
    return ("--hidden-size", str(h), "--num-attention-heads", str(heads), "--group-query-attention",
            "--num-query-groups", "8", "--ffn-hidden-size", str(4 * h), "--apply-layernorm-1p",
            "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
            "--seq-length", "4096", "--max-position-embeddings", "4096", "--vocab-size", "255999",
            "--make-vocab-size-divisible-by", "128")


def _dg(id: str, model: tuple[str, ...], layers: int, tp: int, pp: int, vp: int | None, cp: int, gpus: int,
        batch: int, step_s: float, tflops: float, mbs: int = 1, *extra: str) -> HeldOutRun:
    """A DGX Cloud recipe row: NeMo's settings (the recipes' launcher configs: sequence parallel, the
    distributed optimizer with overlap, TP communication overlapped), 8 H100 per node."""
    virtual = ("--num-layers-per-virtual-pipeline-stage", str(layers // (pp * vp))) if vp else ()
    nemo = _NEMO if tp > 1 else tuple(f for f in _NEMO if f != "--sequence-parallel")  # SP needs TP > 1
    layout = _layout(tp, pp, batch, *nemo, *virtual, "--context-parallel-size", str(cp), *extra, mbs=mbs)
    return HeldOutRun(id, _DG, model, layout, _nodes(gpus, "h100-sxm", "--model-tp-comm-overlap"), layers, tflops,
                      False, step_s=step_s)


def _tt(id: str, model: tuple[str, ...], layers: int, seq: int, local: int, tokens_per_gpu_s: float, tflops: float,
        recompute: str | None) -> HeldOutRun:
    """A torchtitan row: FSDP2 over 64 A100-80GB (ZeRO-3), one micro-batch of ``local`` per rank per step."""
    ac = ("--recompute-granularity", recompute) if recompute else ()
    layout = _layout(1, 1, 64 * local, *_FSDP, *ac, mbs=local)
    return HeldOutRun(id, _TT, model, layout, _nodes(64, "a100-80g"), layers, tflops, False,
                      step_s=local * seq / tokens_per_gpu_s)


_L31_8B, _L31_70B = _llama(4096, 32, 8, 14336, 128256, 8192), _llama(8192, 64, 8, 28672, 128256, 8192)
_L31_405B = _llama(16384, 128, 16, 53248, 128256, 8192)  # 16 KV groups as the recipe plans it
HELD_OUT_V2: list[HeldOutRun] = [
    _dg("DG-GPT3-128", _GPT3, 96, 4, 8, 12, 1, 128, 256, 8.309, 529.5, 1, "--recompute-granularity", "selective"),
    _dg("DG-GPT3-2048", _GPT3, 96, 4, 8, 12, 1, 2048, 4096, 8.49, 518.2, 1, "--recompute-granularity", "selective"),
    _dg("DG-L31-8B-8", _L31_8B, 32, 1, 1, None, 2, 8, 128, 12.91, 587.2),
    _dg("DG-L31-8B-128", _L31_8B, 32, 1, 1, None, 2, 128, 2048, 13.10, 578.7),
    _dg("DG-L31-70B-64", _L31_70B, 80, 4, 4, 5, 2, 64, 128, 14.72, 535.0),
    _dg("DG-L31-70B-2048", _L31_70B, 80, 4, 4, 5, 2, 2048, 4096, 14.98, 527.9),
    _dg("DG-L31-405B-576", _L31_405B, 126, 8, 9, 7, 2, 576, 252, 17.20, 551.7),
    _dg("DG-L31-405B-2304", _L31_405B, 126, 8, 9, 7, 2, 2304, 1008, 17.62, 538.5),
    _dg("DG-N4-15B-16", _nemotron(6144, 48), 32, 4, 1, None, 1, 16, 64, 2.812, 618.0, 4),
    _dg("DG-N4-15B-2048", _nemotron(6144, 48), 32, 4, 1, None, 1, 2048, 8192, 2.887, 602.0, 4),
    _dg("DG-N4-340B-128", _nemotron(18432, 96), 96, 8, 8, 12, 1, 128, 32, 4.61, 547.7),
    _dg("DG-N4-340B-2048", _nemotron(18432, 96), 96, 8, 8, 12, 1, 2048, 512, 4.84, 521.7),
    _tt("TT-L3-8B", _llama(4096, 32, 8, 14336, 128256, 8192), 32, 8192, 1, 2973, 181.6, "selective"),
    _tt("TT-L3-70B", _llama(8192, 64, 8, 28672, 128256, 8192), 80, 8192, 1, 331, 161.3, "full"),
    _tt("TT-L2-13B", _llama(5120, 40, 40, 13824, 32000, 4096), 40, 4096, 2, 2162, 190.6, None),
    _tt("TT-L2-70B", _llama(8192, 64, 8, 28672, 32000, 4096), 80, 4096, 2, 353, 157.6, "full"),
]

# Reported, not bound (docs/planning.md gives the reasons).
REPORTED: list[HeldOutRun] = [
    HeldOutRun("Qwen3-235B", _QWEN3, _QWEN3_MODEL,
               _layout(2, 1, 2048, "--bf16", "--sequence-parallel", "--expert-model-parallel-size", "8",
                       "--expert-tensor-parallel-size", "1", "--use-distributed-optimizer", "--overlap-grad-reduce",
                       "--overlap-param-gather", "--recompute-granularity", "full", mbs=4),
               _nodes(256, "h100-sxm"), 94, 276.0, False, bound=False),
]


def plan_row(run: HeldOutRun):
    """(the plan, its predicted TFLOP/s per GPU counted as the row's source counts them). Rows planned with
    selective recomputation that do not fit are planned with full recomputation, and rows whose source does
    not state it without, then selective, then full, until they fit (the protocols' rules)."""
    from megalite.planning.cli import plan_config

    plan, cfg = plan_config(run.flags(), list(run.cluster))
    if not plan.fits and "selective" in run.layout:
        flags = [("full" if f == "selective" else f) for f in run.flags()]
        plan, cfg = plan_config(flags, list(run.cluster))
    for granularity in ("selective", "full") if run.recompute_unstated else ():
        if plan.fits:
            break
        plan, cfg = plan_config([*run.flags(), "--recompute-granularity", granularity], list(run.cluster))
    if run.step_s is not None:  # round 2: by step time, in the source's own FLOPs count
        return plan, run.tflops_per_gpu * run.step_s / plan.time.step_s
    return plan, plan.time.tflops_per_gpu(run.counts_recompute) * _flops_share(run, plan)


def _flops_share(run: HeldOutRun, plan) -> float:
    """FLOPs of the real layers over those of the planned ones (1 unless the stages are uneven)."""
    if not run.planned_layers:
        return 1.0
    from megalite.planning.flops import flops_per_token

    sh = plan.shape
    real = _with_layers(sh.cfg.model, run.layers)
    return flops_per_token(real, sh.padded_vocab, sh.s) / flops_per_token(sh.cfg.model, sh.padded_vocab, sh.s)


def _with_layers(model, layers: int):
    import copy

    out = copy.copy(model)
    out.num_layers = layers
    return out


# Round 3 (docs/planning.md, "Held-out validation, round 3"): the rows of docs/heldout_v3_rows.md, entered
# before any prediction for them was computed, with that file's settings and assumptions and the protocol's
# rules. LF: MosaicML llm-foundry's MPT benchmarks (Composer FSDP, which prefetches: both DP overlaps);
# MC / MZ: Megatron-Core's MoE figures; DG-GROK: DGX Cloud's Grok-1 recipe (NeMo). Compared by step time.
_LF = "MosaicML llm-foundry scripts/train/benchmarking/README.md (github.com/mosaicml/llm-foundry)"
_MC = "Megatron-LM megatron/core/transformer/moe/README.md (github.com/NVIDIA/Megatron-LM)"
_MZ = "Megatron-MoE-ModelZoo best_practice/mixtral/run_mixtral_8x22B.sh (github.com/yanring/Megatron-MoE-ModelZoo)"
_DG_GROK = "NVIDIA DGX Cloud Benchmarking recipes grok1/README.md (github.com/NVIDIA/dgxc-benchmarking)"
_MPT = {"1b": (24, 2048, 16), "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40),
        "30b": (48, 7168, 56), "70b": (80, 8192, 64)}  # layers, d_model, heads (the recipes' yamls)
_NO_DROPOUT = ("--hidden-dropout", "0", "--attention-dropout", "0")  # MPTConfig's defaults; Mixtral's config
_SHARDING = {"FULL_SHARD": "optim_grads_params", "SHARD_GRAD_OP": "optim_grads"}


def _lf(id: str, size: str, seq: int, gpus: int, gpu: str, mbs: int, ga: int, recompute: bool, sharding: str,
        step_s: float, tflops: float, pure: bool = False, per_block: bool = False) -> HeldOutRun:
    """An MPT row: GPT-style (learned positions, biases, LayerNorm, GeLU, tied embedding, MHA, 4d MLP),
    vocab 50368 unpadded, no dropout, flash attention, FSDP with both overlaps, bf16 (fp32 gradient reduction unless
    Composer's PURE mode)."""
    layers, h, heads = _MPT[size]
    model = ("--hidden-size", str(h), "--num-attention-heads", str(heads), "--seq-length", str(seq),
             "--max-position-embeddings", str(seq), "--vocab-size", "50368", "--make-vocab-size-divisible-by", "64",
             *_NO_DROPOUT)
    block = 12 * h * h + 13 * h  # one block's parameters: FSDP's unit (round 4's rule for SHARD_GRAD_OP)
    extra = (*(("--recompute-granularity", "full") if recompute else ()),
             *(("--grad-reduce-in-bf16",) if pure else ()),
             *(("--ddp-bucket-size", str(block)) if per_block and sharding == "SHARD_GRAD_OP" else ()))
    layout = _layout(1, 1, mbs * ga * gpus, "--bf16", "--data-parallel-sharding-strategy", _SHARDING[sharding],
                     "--overlap-grad-reduce", "--overlap-param-gather", *extra, mbs=mbs)
    return HeldOutRun(id, _LF, model, layout, _nodes(gpus, gpu), layers, tflops, False, step_s=step_s)


def _mixtral(h: int, heads: int, ffn: int, vocab: int, seq: int) -> tuple[str, ...]:
    return (*_llama(h, heads, 8, ffn, vocab + 1, seq), "--num-experts", "8", "--moe-router-topk", "2",
            "--moe-ffn-hidden-size", str(ffn), "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm",
            *_NO_DROPOUT)


def _mcore(tp: int, pp: int, cp: int, batch: int, *extra: str) -> tuple[str, ...]:
    """A Megatron-Core MoE layout: one layer per virtual stage, EP8 with expert-TP 1, the distributed
    optimizer with both overlaps, no recomputation."""
    sp = ("--sequence-parallel",) if tp > 1 else ()
    return _layout(tp, pp, batch, "--bf16", *sp, "--num-layers-per-virtual-pipeline-stage", "1",
                   "--context-parallel-size", str(cp), "--expert-model-parallel-size", "8",
                   "--expert-tensor-parallel-size", "1", "--use-distributed-optimizer", "--overlap-grad-reduce",
                   "--overlap-param-gather", *extra)


_H, _A = "h100-sxm", "a100-80g"
HELD_OUT_V3: list[HeldOutRun] = [
    _lf("LF-H-70B-512", "70b", 2048, 512, _H, 8, 1, True, "FULL_SHARD", 16.27, 408.0),
    _lf("LF-H-70B-128", "70b", 2048, 128, _H, 8, 1, True, "FULL_SHARD", 15.48, 428.0),
    _lf("LF-H-30B-256", "30b", 2048, 256, _H, 8, 1, True, "FULL_SHARD", 7.63, 404.0),
    _lf("LF-H-13B-128", "13b", 2048, 128, _H, 16, 1, True, "FULL_SHARD", 6.45, 417.0),
    _lf("LF-H-7B-512", "7b", 2048, 512, _H, 6, 1, False, "FULL_SHARD", 1.27, 417.0),
    _lf("LF-H-3B-128", "3b", 2048, 128, _H, 8, 1, False, "SHARD_GRAD_OP", 0.70, 419.0),
    _lf("LF-H-1B-512", "1b", 2048, 512, _H, 12, 1, False, "SHARD_GRAD_OP", 0.62, 362.0),
    _lf("LF-H-7B-8K-8", "7b", 8192, 8, _H, 8, 2, True, "FULL_SHARD", 18.90, 367.0),
    _lf("LF-H-13B-2K-8", "13b", 2048, 8, _H, 2, 1, False, "FULL_SHARD", 0.855, 393.0),
    _lf("LF-A-70B-64", "70b", 2048, 64, _A, 8, 4, True, "FULL_SHARD", 159.6, 166.0, pure=True),
    _lf("LF-A-30B-8", "30b", 2048, 8, _A, 3, 21, True, "FULL_SHARD", 140.8, 172.0),
    _lf("LF-A-13B-8K-8", "13b", 8192, 8, _A, 5, 3, True, "FULL_SHARD", 68.4, 174.0),
    _lf("LF-A-7B-8", "7b", 2048, 8, _A, 6, 2, False, "FULL_SHARD", 5.30, 200.0),
    HeldOutRun("MC-MIX8x7B-64", _MC, _mixtral(4096, 32, 14336, 32000, 4096), _mcore(1, 4, 1, 256),
               _nodes(64, _H, "--model-te-layers"), 32, 468.0, False, step_s=2.90, recompute_unstated=True),
    HeldOutRun("MZ-MIX8x22B-128", _MZ, _mixtral(6144, 48, 16384, 32000, 4096), _mcore(2, 8, 1, 256),
               _nodes(128, _H, "--model-te-layers", "--model-tp-comm-overlap"), 56, 465.0, False, step_s=4.27,
               recompute_unstated=True),
    HeldOutRun("DG-GROK1-512", _DG_GROK, _mixtral(6144, 48, 32768, 128256, 8192),
               _mcore(4, 8, 2, 1024, "--grad-reduce-in-bf16"),
               _nodes(512, _H, "--model-te-layers", "--model-tp-comm-overlap"), 64, 536.0, False, step_s=15.933,
               recompute_unstated=True),
]


# Round 4 (docs/planning.md, "Held-out validation, round 4"): docs/heldout_v4_rows.md's 23 llm-foundry rows, chosen
# by a rule stated before their figures were read, entered before any prediction for them, planned by round 3's
# rules and round 4's (a SHARD_GRAD_OP row's collectives per block).
HELD_OUT_V4: list[HeldOutRun] = [
    _lf("LF-H-70B-64", "70b", 2048, 64, _H, 8, 4, True, "FULL_SHARD", 63.1, 421.0),
    _lf("LF-H-70B-32", "70b", 2048, 32, _H, 2, 16, True, "FULL_SHARD", 74.3, 357.0),
    _lf("LF-H-30B-32", "30b", 2048, 32, _H, 14, 3, True, "FULL_SHARD", 37.3, 434.0),
    _lf("LF-H-30B-16", "30b", 2048, 16, _H, 10, 3, True, "FULL_SHARD", 27.1, 426.0),
    _lf("LF-H-13B-64", "13b", 2048, 64, _H, 2, 1, False, "FULL_SHARD", 0.853, 394.0),
    _lf("LF-H-13B-16", "13b", 2048, 16, _H, 2, 1, False, "FULL_SHARD", 0.859, 391.0),
    _lf("LF-H-3B-64", "3b", 2048, 64, _H, 6, 3, False, "FULL_SHARD", 1.64, 403.0),
    _lf("LF-H-3B-16", "3b", 2048, 16, _H, 10, 3, False, "FULL_SHARD", 2.54, 432.0),
    _lf("LF-H-1B-64", "1b", 2048, 64, _H, 20, 1, False, "FULL_SHARD", 0.922, 404.0),
    _lf("LF-H-1B-16", "1b", 2048, 16, _H, 20, 1, False, "FULL_SHARD", 0.89, 419.0),
    _lf("LF-H-30B-8K-8", "30b", 8192, 8, _H, 1, 21, True, "FULL_SHARD", 124.3, 296.0),
    _lf("LF-H-13B-32K-8", "13b", 32768, 8, _H, 1, 3, True, "FULL_SHARD", 49.7, 313.0),
    _lf("LF-H-7B-32K-8", "7b", 32768, 8, _H, 2, 2, True, "FULL_SHARD", 39.5, 306.0),
    _lf("LF-H-3B-32K-8", "3b", 32768, 8, _H, 3, 6, True, "FULL_SHARD", 100.4, 285.0),
    _lf("LF-H-1B-32K-8", "1b", 32768, 8, _H, 1, 4, False, "FULL_SHARD", 10.9, 331.0),
    _lf("LF-A-70B-32", "70b", 2048, 32, _A, 2, 16, True, "FULL_SHARD", 175.3, 151.0, pure=True),
    _lf("LF-A-30B-s512-8", "30b", 512, 8, _A, 12, 21, True, "FULL_SHARD", 133.4, 175.0),
    _lf("LF-A-13B-1K-8", "13b", 1024, 8, _A, 40, 3, True, "FULL_SHARD", 52.7, 185.0),
    _lf("LF-A-7B-1K-8", "7b", 1024, 8, _A, 64, 2, True, "FULL_SHARD", 30.1, 180.0),
    _lf("LF-A-3B-s512-8", "3b", 512, 8, _A, 40, 6, False, "FULL_SHARD", 10.1, 198.0),
    _lf("LF-A-1B-s512-8", "1b", 512, 8, _A, 56, 4, False, "FULL_SHARD", 4.95, 189.0),
    _lf("LF-H-3B-256", "3b", 2048, 256, _H, 8, 1, False, "SHARD_GRAD_OP", 0.719, 408.0, per_block=True),
    _lf("LF-H-1B-128", "1b", 2048, 128, _H, 12, 1, False, "SHARD_GRAD_OP", 0.557, 401.0, per_block=True),
]
