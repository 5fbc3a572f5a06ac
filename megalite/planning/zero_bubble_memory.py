"""Zero-bubble holds: how many chunk-micro-batches each rank keeps between F and W so that no rank passes
1F1B's highest (docs/design.md §3.4, measured by bench/zero_bubble_memory.py).

A zero-bubble schedule moves bytes between ranks rather than adding them evenly: ZB-H1's last rank keeps
up to p - 1 pending W's beside the loss's logits, ZB-V's rank 0 both vocabulary matrices, the loss and the
most micro-batches in flight. Each rank's peak is its table played with its chunks' bytes
(``pipeline/timeline.py:peak_live_bytes``; the bytes from the model: ``planning/memory.py:rank_chunks``),
and ``choose_holds`` gives each rank the largest hold (``ScheduleSpec.holds``) whose played peak stays
within its room (1F1B's highest rank's bytes less its own state) with a bubble below 1F1B's; where none
does (a rank whose state alone nearly fills 1F1B's highest: ZB-V's rank 0 at large vocabularies), the
smallest hold that costs no bubble. A hold below the schedule's own costs bubble where it delays fewer W's
(ZB-H1: a step of span per W its last rank no longer delays) and often none for ZB-V's rank 0 down to
about 2p - 3, so it is lowered only as far as the bound needs. Training runs the holds chosen
(``planning/memory.py:run_holds``), so the planner's bytes and bubble are those of the tables that run.
Pure arithmetic over the tables and the bytes given.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from megalite.pipeline.schedule_table import ScheduleSpec, build_tables
from megalite.pipeline.timeline import ChunkBytes, peak_live_bytes, spec_for
from megalite.planning.shape import RunShape
from megalite.planning.zero_bubble import zero_bubble_unit_idle


@lru_cache(maxsize=4096)
def played(spec: ScheduleSpec, rank: int, chunks: tuple[ChunkBytes, ...]) -> tuple[float, float]:
    """``peak_live_bytes`` of rank ``rank``'s table of ``spec`` (cached: the planner asks per layout)."""
    return peak_live_bytes(_tables(spec)[rank], chunks)


@lru_cache(maxsize=512)
def _tables(spec: ScheduleSpec) -> tuple[tuple, ...]:
    return tuple(tuple(t) for t in build_tables(spec))


def search_micro_batches(p: int, m: int) -> int:
    """Micro-batches the hold search plays: a rank's peak is reached within the first 4p (the tables' steady
    phase repeats from there; ZB-V's own tables by 2p), so longer steps are searched short."""
    return min(m, 4 * p)


def one_f_one_b(sh: RunShape) -> RunShape | None:
    """The same run under 1F1B with the layers cut evenly (the baseline the zero-bubble bound is stated
    against); None where an even cut over p ranks does not exist."""
    cfg = sh.cfg
    if cfg.model.num_layers % sh.pp:
        return None
    parallel = dataclasses.replace(cfg.parallel, pipeline_schedule="1f1b", pipeline_model_parallel_layout=None,
                                   decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
                                   account_for_embedding_in_pipeline_split=False,
                                   account_for_loss_in_pipeline_split=False)
    base = RunShape.of(dataclasses.replace(cfg, parallel=parallel), sh.world, sh.vocab)
    return dataclasses.replace(base, te_layers=sh.te_layers)


@lru_cache(maxsize=256)
def choose_holds(name: str, p: int, m: int, chunks: tuple[tuple[ChunkBytes, ...], ...], room: tuple[float, ...]
                 ) -> tuple[int, ...] | None:
    """Rank by rank (each rank's table may depend on the others' holds: ZB-V's), keeping the ranks fitted
    before it within their room: the largest hold whose played bytes fit ``room`` with a bubble (F = B = W, in
    chunk steps) below 1F1B's 3(p - 1) stage steps; else, going down from its own, the smallest hold before
    the bubble first grows. None: every rank keeps the schedule's own. Played on ``search_micro_batches``."""
    m = search_micro_batches(p, m)
    spec = spec_for(name, p, m)
    own, budget = p * spec.vp, 3 * (p - 1) * spec.vp
    holds, fitted = [own] * p, []
    free_idle = zero_bubble_unit_idle(name, p, m, None)

    def tables_at(r: int, h: int) -> tuple[tuple[int, ...], tuple | None]:
        trial = tuple(holds[:r] + [h] + holds[r + 1:])
        try:
            return trial, _tables(dataclasses.replace(spec, holds=None if max(trial) == min(trial) == own else trial))
        except (ValueError, RuntimeError):  # no valid table at this hold (nor below it)
            return trial, None

    def within(tables: tuple, ranks: list[int]) -> bool:
        return all(peak_live_bytes(tables[q], chunks[q])[0] <= room[q] for q in ranks)

    for r in range(p):
        chosen = None
        for h in range(own, 0, -1):
            trial, tables = tables_at(r, h)
            if tables is None:
                break
            if within(tables, fitted) and within(tables, [r]):
                chosen = h if h == own or zero_bubble_unit_idle(name, p, m, trial) < budget else None
                break
        if chosen is not None:
            holds[r] = chosen
            fitted.append(r)
            continue
        for h in range(own - 1, 0, -1):  # no hold fits: the ones that cost no bubble
            trial, tables = tables_at(r, h)
            if tables is None or not within(tables, fitted) or zero_bubble_unit_idle(name, p, m, trial) > free_idle:
                break
            holds[r] = h
    return None if all(h == own for h in holds) else tuple(holds)
