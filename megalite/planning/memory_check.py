"""The start-up memory check: the planner's bytes per rank against the memory the ranks have.

pretrain_gpt.py calls it after the flags are validated and before any process group, model or tensor
exists, so a run that cannot fit (a vocabulary or a sequence of millions) stops in seconds, naming the
estimate, its largest terms and the flags behind them, instead of dying in the allocator minutes later.
The estimate is peak_memory() of planning/memory.py (the same numbers as --dry-run and tools/plan.py);
--skip-memory-check starts the run anyway. A combination the planner cannot estimate is warned about,
never refused.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megalite.config.arguments import MegaliteConfig
from megalite.planning.cli import DEFAULT_VOCAB, vocab_of
from megalite.planning.estimate import fmt_bytes
from megalite.planning.memory import (
    MemoryReport,
    core_attention_bytes,
    embedding_params,
    logits_bytes,
    losses_in_flight,
    output_params,
    peak_memory,
    stage_dense_params,
)
from megalite.planning.shape import RunShape

if TYPE_CHECKING:
    from megalite.device import MemoryCapacity

SKIP_FLAG = "--skip-memory-check"
PARAM_TERMS = ("weights", "gradients", "optimizer state")


class MemoryCheckError(ValueError):
    """The planner's estimate per rank exceeds the memory the ranks have; the message names the
    estimate, its largest terms and the flags that drive them."""


def check_vocab(cfg: MegaliteConfig) -> tuple[int, str]:
    """The vocabulary the estimate uses and how to name it: --vocab-size V (NullTokenizer: V + 1 ids),
    else GPT-2's (a tokenizer read from files is not opened here; its embedding is rarely the term that
    decides)."""
    named = f"--vocab-size {cfg.data.vocab_size}" if cfg.data.vocab_size else f"vocabulary {DEFAULT_VOCAB} (assumed)"
    return vocab_of(cfg), named


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e5 else f"{n:.0f}"


def _params_driver(sh: RunShape, stage: int, vocab_flag: str) -> str:
    """Which flags make a rank's parameters: the vocabulary's rows, the learned positions, or the layers."""
    m = sh.cfg.model
    n = stage_dense_params(sh, stage)
    word = sh.padded_vocab // sh.tp * sh.h
    pos = embedding_params(sh) - word if stage == 0 else 0
    vocab = (word if stage == 0 else 0) + (output_params(sh) if stage == sh.pp - 1 else 0)
    split = (f" / --tensor-model-parallel-size {sh.tp}" if sh.tp > 1 else "") + (
        f" / --pipeline-model-parallel-size {sh.pp}" if sh.pp > 1 else "")
    parts = {f"{vocab_flag} x --hidden-size {m.hidden_size}{split}": vocab,
             f"--max-position-embeddings {m.max_position_embeddings} x --hidden-size {m.hidden_size}": pos,
             f"--num-layers {m.num_layers} x --hidden-size {m.hidden_size} x --ffn-hidden-size "
             f"{m.ffn_hidden_size}{split}": n - vocab - pos}
    return f"{_count(n)} parameters, mostly {max(parts, key=parts.__getitem__)}"


def _activation_driver(sh: RunShape, stage: int, vocab_flag: str) -> str:
    """Which flags make the activations: the logits, the unfused attention scores, or the layers."""
    m, t = sh.cfg.model, sh.cfg.training
    tokens = f"--seq-length {m.seq_length} x --micro-batch-size {t.micro_batch_size}"
    logits = losses_in_flight(sh) * logits_bytes(sh, stage)
    scores = core_attention_bytes(sh) * sh.layers_per_stage
    if logits >= scores and logits > 0:
        return f"{tokens} x {vocab_flag} (fp32 logits)"
    if m.attention_backend in ("unfused", "local"):
        return f"{tokens} x --seq-length {m.seq_length} x --num-attention-heads {m.num_attention_heads} " \
               f"(--attention-backend {m.attention_backend} keeps the scores)"
    return f"{tokens} x --hidden-size {m.hidden_size} x --num-layers {m.num_layers}"


def _driver(sh: RunShape, report: MemoryReport, term: str, vocab_flag: str) -> str:
    if term in PARAM_TERMS:
        return _params_driver(sh, report.stage, vocab_flag)
    if term == "activations":
        return _activation_driver(sh, report.stage, vocab_flag)
    if term.startswith("expert") or term.startswith("MoE"):
        m = sh.cfg.model
        return f"--num-experts {m.num_experts} x --moe-ffn-hidden-size {m.expert_ffn_hidden_size}"
    return ""


def refusal(sh: RunShape, report: MemoryReport, capacity: MemoryCapacity, vocab_flag: str) -> str:
    """One line: the estimate, what it is compared with, the three largest terms and their flags."""
    per_rank = capacity.total / capacity.ranks
    share = (f"{fmt_bytes(capacity.total).strip()} shared by {capacity.ranks} ranks = "
             f"{fmt_bytes(per_rank).strip()} each" if capacity.ranks > 1 else fmt_bytes(capacity.total).strip())
    largest = sorted(report.terms.items(), key=lambda kv: -kv[1])[:3]
    terms = "; ".join(f"{name} {fmt_bytes(value).strip()}"
                      + (f" ({d})" if (d := _driver(sh, report, name, vocab_flag)) else "")
                      for name, value in largest)
    return (f"memory check: the planner estimates {fmt_bytes(report.total).strip()} per rank (pipeline rank "
            f"{report.stage}), more than {capacity.what}: {share}. Largest terms: {terms}. Lower those flags "
            f"(docs/troubleshooting.md, 'Out of memory'), or pass {SKIP_FLAG} to start anyway")


def check_memory(cfg: MegaliteConfig, world: int, capacity: MemoryCapacity | None) -> str | None:
    """Raise MemoryCheckError when the estimate per rank exceeds ``capacity`` (a validated ``cfg``);
    return a warning when the check cannot be made, else None."""
    if cfg.training.skip_memory_check:
        return None
    if capacity is None:
        return f"memory check skipped: this host does not report its available memory ({SKIP_FLAG} silences this)"
    vocab, vocab_flag = check_vocab(cfg)
    try:
        sh = RunShape.of(cfg, world, vocab)
        report = peak_memory(sh)
        total = report.total
        if math.isnan(total):
            raise ValueError("the estimate is not a number")
    except (ArithmeticError, ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        return (f"memory check skipped: the planner cannot estimate this configuration ({type(e).__name__}: {e}); "
                f"{SKIP_FLAG} silences this")
    if total > capacity.total / capacity.ranks:
        raise MemoryCheckError(refusal(sh, report, capacity, vocab_flag))
    return None
