"""ZB-V's vocabulary-balanced layout: the split a plan suggests when a V's rank 0 passes 1F1B's peak.

A V puts the first stage and the last on rank 0, so with untied embeddings that rank holds both vocabulary
matrices, their gradients and their optimizer state, where 1F1B spreads them over its first and last ranks.
At large vocabularies no order of the schedule's table brings rank 0 back within 1F1B's highest
(``zero_bubble_memory.py`` bounds only what the table moves); moving layers off rank 0 does
(``--pipeline-model-parallel-layout``; the memory is measured by bench/zero_bubble_memory.py). This module
tries the splits that give rank 0 fewer layers than the others and returns the one whose planned highest
rank is least. The floor it cannot pass: rank 0's two vocabulary matrices and their state, which a 1F1B
with its own vocabulary-balanced split does not hold on one rank (docs/parallelism.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from megalite.config.arguments import MegaliteConfig
from megalite.planning.memory import stage_memory
from megalite.planning.shape import RunShape
from megalite.planning.zero_bubble_memory import one_f_one_b

LIMIT = 1.05  # the zero-bubble memory claim: the highest rank within 5 % of 1F1B's even split


@dataclass(frozen=True)
class VocabBalance:
    even: float  # the run's highest rank (bytes) over 1F1B's even split's highest
    layout: str  # the suggested --pipeline-model-parallel-layout
    balanced: float  # its highest rank over the same 1F1B's


def highest_rank_bytes(sh: RunShape) -> float:
    """The planned bytes of the fullest pipeline rank (every rank asked: an uneven V's may be any)."""
    return max(stage_memory(sh, r).total for r in range(sh.pp))


def v_layout(counts: list[int]) -> str:
    """Megalite's layout string of 2p stage layer counts in V order (stage 0 opens with E, the last closes
    with L)."""
    parts = ["t" * n for n in counts]
    parts[0], parts[-1] = "E" + parts[0], parts[-1] + "L"
    return "|".join(parts)


def _split_rank(n: int) -> tuple[int, int]:
    return n // 2, n - n // 2


def candidate_layouts(layers: int, p: int) -> list[str]:
    """V splits with rank 0 at k layers (0 up to an even share) and the rest spread as evenly as the layers
    allow over ranks 1..p-1 (the extra layers on the first ranks, or on the last); every middle stage keeps
    at least one layer."""
    out = []
    for k in range(0, -(-layers // p) + 1):
        base, extra = divmod(layers - k, p - 1)
        for extra_first in (True, False):
            per = [base + (1 if (i < extra if extra_first else i >= p - 1 - extra) else 0) for i in range(p - 1)]
            counts = [0] * (2 * p)
            counts[0], counts[-1] = _split_rank(k)
            for r, n in enumerate(per, start=1):
                counts[r], counts[2 * p - 1 - r] = _split_rank(n)
            if min(counts[1:-1]) >= 1:
                out.append(v_layout(counts))
    return list(dict.fromkeys(out))


def zbv_vocab_balance(sh: RunShape, highest: Callable[[RunShape], float] = highest_rank_bytes
                      ) -> VocabBalance | None:
    """For an even-split ZB-V run with untied embeddings whose planned highest rank (``highest``: bytes of a
    plan's fullest rank) passes ``LIMIT`` x 1F1B's even split: the layout whose highest is least, with both
    ratios. None where the run is within the limit, or not such a run."""
    cfg = sh.cfg
    p = cfg.parallel
    if (p.pipeline_schedule != "zbv" or sh.pp < 2 or not cfg.model.untie_embeddings_and_output_weights
            or p.pipeline_model_parallel_layout is not None or p.decoder_first_pipeline_num_layers is not None
            or p.decoder_last_pipeline_num_layers is not None or p.account_for_embedding_in_pipeline_split
            or p.account_for_loss_in_pipeline_split or cfg.model.mtp_num_layers):  # a split given, or no layout
        return None
    base = one_f_one_b(sh)
    if base is None:
        return None
    bound = highest(base)
    even = highest(sh) / bound
    if even <= LIMIT:
        return None
    best = None
    for layout in candidate_layouts(cfg.model.num_layers, sh.pp):
        parallel = dataclasses.replace(p, pipeline_model_parallel_layout=layout)
        try:
            trial = dataclasses.replace(RunShape.of(dataclasses.replace(cfg, parallel=parallel), sh.world, sh.vocab),
                                        te_layers=sh.te_layers)
            ratio = highest(trial) / bound
        except (ValueError, ZeroDivisionError):  # a split this model's layers cannot take
            continue
        if best is None or ratio < best[1]:
            best = (layout, ratio)
    return None if best is None or best[1] >= even else VocabBalance(even, best[0], best[1])


def layout_hint(sh: RunShape) -> str | None:
    """The line the plan and a training run's start print for a ZB-V run past the bound (None: nothing to say)."""
    vb = zbv_vocab_balance(sh)
    if vb is None:
        return None
    return (f"ZB-V puts both vocabulary matrices on rank 0: its highest rank plans {vb.even:.2f} x 1F1B's (even "
            f"split); --pipeline-model-parallel-layout \"{vb.layout}\" plans {vb.balanced:.2f} x "
            "(docs/parallelism.md, \"Zero-bubble schedules\")")


def run_layout_hint(cfg: MegaliteConfig, world: int, vocab: int) -> str | None:
    """``layout_hint`` of a training run's config."""
    if cfg.parallel.pipeline_schedule != "zbv":
        return None
    return layout_hint(RunShape.of(cfg, world, vocab))
