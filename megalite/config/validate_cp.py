"""The context-parallel flags' rules: --cp-comm-type (one value or one per layer), the hierarchical sizes
of a2a+p2p, and what each comm type needs of the sequence and of the heads (config/parallel.py holds the
flags). The heads are counted as the model holds them (``ModelConfig.heads_per_tp_rank``), so a layout
these rules accept builds and runs."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megalite.config.parallel import CP_COMM_SPELLINGS, CP_COMM_TYPES

if TYPE_CHECKING:
    from megalite.config.arguments import MegaliteConfig

HCP = "--hierarchical-context-parallel-sizes"


def _names() -> str:
    spelled = {v: k for k, v in CP_COMM_SPELLINGS.items()}
    return ", ".join(f"{t} (or {spelled[t]})" if t in spelled else t for t in CP_COMM_TYPES)


def cp_comm_errors(cfg: "MegaliteConfig") -> list[str]:
    """Whatever the CP size: every --cp-comm-type value is known, the list has one value or one per layer,
    and the hierarchical sizes multiply to --context-parallel-size (Megatron-LM checks the same)."""
    p, layers = cfg.parallel, cfg.model.num_layers
    errors = [f"--cp-comm-type {t!r} is not one of {_names()}" for t in dict.fromkeys(p.cp_comm_type)
              if t not in CP_COMM_TYPES]
    n = len(p.cp_comm_type)
    if n not in (1, layers):
        errors.append(f"--cp-comm-type has {n} values: give one (for every layer) or one per layer "
                      f"(--num-layers {layers})")
    sizes, cp = p.hierarchical_context_parallel_sizes, p.context_parallel_size
    if sizes is not None and not sizes:
        errors.append(f"{HCP} needs at least one size (the all-to-all group's)")
    elif sizes is not None and math.prod(sizes) != cp:
        errors.append(f"{HCP} ({' x '.join(map(str, sizes))} = {math.prod(sizes)}) must multiply to "
                      f"--context-parallel-size ({cp})")
    return errors


def _per_rank(n: int, tp: int, local: int) -> str:
    """How a count per tensor-parallel rank came about: '8 / 2 = 4', or '1 over 2 ranks: 1 each, replicated'."""
    return f"{n} / {tp} = {local}" if n >= tp else f"{n} over {tp} ranks: {local} each, replicated"


def head_split_errors(cfg: "MegaliteConfig") -> list[str]:
    """a2a splits each TP rank's heads and query groups c ways, a2a+p2p the first hierarchical size's ways."""
    m, p = cfg.model, cfg.parallel
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    heads, groups = m.heads_per_tp_rank(tp)
    sizes = p.hierarchical_context_parallel_sizes
    splits = {"a2a": (cp, f"--context-parallel-size ({cp})", "use --cp-comm-type p2p or allgather")}
    if sizes:
        splits["a2a+p2p"] = (sizes[0], f"the all-to-all size, the first {HCP} ({sizes[0]})",
                             f"use a smaller first {HCP}, or --cp-comm-type p2p")
    errors = []
    for kind in dict.fromkeys(p.cp_comm_type):
        if kind not in splits:
            continue
        ways, by, fix = splits[kind]
        for flag, n, local in (("--num-attention-heads", m.num_attention_heads, heads),
                               ("--num-query-groups", m.num_query_groups or m.num_attention_heads, groups)):
            if local % ways:
                errors.append(f"--cp-comm-type {kind}: {flag} per tensor-parallel rank ({_per_rank(n, tp, local)}) "
                              f"must be divisible by {by}; {fix}")
    return errors


def context_parallel_errors(cfg: "MegaliteConfig") -> list[str]:
    """--context-parallel-size c > 1: the sequence is cut into 2c equal chunks (each further split over
    TP with sequence parallelism); the all-to-all comm types split every rank's heads; a2a+p2p needs its
    hierarchical sizes."""
    m, p = cfg.model, cfg.parallel
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    errors = []
    unit = 2 * cp * (tp if p.sequence_parallel else 1)
    if m.seq_length % unit:
        sp = " x --tensor-model-parallel-size (sequence parallelism)" if p.sequence_parallel else ""
        errors.append(f"--seq-length ({m.seq_length}) must be divisible by 2 x --context-parallel-size ({cp}){sp}"
                      f" = {unit}")
    if "a2a+p2p" in p.cp_comm_type and p.hierarchical_context_parallel_sizes is None:
        errors.append(f"--cp-comm-type a2a+p2p needs {HCP} (the all-to-all group's size, then the ring's, "
                      f"multiplying to --context-parallel-size {cp})")
    errors += head_split_errors(cfg)
    if p.hierarchical_dp_reduce:
        errors.append("--hierarchical-dp-reduce is not supported with --context-parallel-size > 1 (gradients are "
                      "reduced over the data x context parallel group)")
    return errors
