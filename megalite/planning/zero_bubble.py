"""Zero-bubble schedules (zb-h1, zbv) in the plan: the bytes a deferred W keeps (docs/design.md §3.4) times
the schedule table's peak pending W's, and the idle time of the table played with the plan's F, B, W.

Pure arithmetic: the planner and bench/split_backward_memory.py read the same formula.
"""

from __future__ import annotations

from functools import lru_cache

from megalite.config.model import ModelConfig
from megalite.pipeline.schedule_table import build_tables
from megalite.pipeline.timeline import SCHEDULES, idle_per_rank, peak_pending_w, play, spec_for

ZERO_BUBBLE = ("zb-h1", "zbv")


def layer_elements(cfg: ModelConfig, tokens: int, tp: int, sp: bool) -> int:
    """Elements one dense transformer layer keeps for W: per GEMM its input and its output gradient.

    tokens = s·b. Column-parallel GEMMs (QKV, fc1) take the full input, or its 1/tp sequence shard with
    SP (all-gathered again in W), and give 1/tp of the outputs; row-parallel ones (proj, fc2) take 1/tp
    of the inputs and give the full output, whose gradient is whole on every rank."""
    h, d, f = cfg.hidden_size, cfg.kv_channels, cfg.ffn_hidden_size
    qkv_out = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * d
    col_in = h // tp if sp else h
    qkv = col_in + qkv_out // tp
    proj = cfg.num_attention_heads * d // tp + h
    fc1 = col_in + (2 * f if cfg.swiglu else f) // tp
    fc2 = f // tp + h
    return tokens * (qkv + proj + fc1 + fc2)


def output_bytes(cfg: ModelConfig, tokens: int, padded_vocab: int, tp: int, sp: bool, element: int) -> int:
    """The output layer's: unfused, its input and the logits' gradient [s·b, v/tp]; fused with the
    cross-entropy, the per-token upstream gradient (fp32) and the fp32 partial weight gradient the fusion
    keeps anyway."""
    if cfg.cross_entropy_loss_fusion:
        return 4 * tokens + 4 * padded_vocab // tp * cfg.hidden_size
    col_in = cfg.hidden_size // tp if sp else cfg.hidden_size
    return element * tokens * (col_in + padded_vocab // tp)


def deferred_w_bytes(cfg: ModelConfig, layers: int, tokens: int, padded_vocab: int, tp: int = 1, sp: bool = False,
                     output: bool = True, element: int = 4) -> int:
    """One pending W of a stage holding ``layers`` dense layers (and the output layer with ``output``)."""
    total = element * layers * layer_elements(cfg, tokens, tp, sp)
    return total + (output_bytes(cfg, tokens, padded_vocab, tp, sp, element) if output else 0)


def steady_micro_batches(p: int, m: int) -> int:
    """Micro-batches to play for the idle time, which stops growing with m once the steady phase is
    reached (m >= 2p covers ZB-V's): long steps are played short."""
    return min(m, 2 * p)


def pending_w(name: str, p: int, m: int, rank: int) -> int:
    """Most W's rank ``rank`` has pending at once in the named table of all m micro-batches (ZB-H1: r + 1;
    ZB-V: in chunks, still growing with m past 2p on some ranks)."""
    return _pending(name, p, m)[rank]


@lru_cache(maxsize=64)
def _pending(name: str, p: int, m: int) -> tuple[int, ...]:
    return tuple(peak_pending_w(table) for table in build_tables(spec_for(name, p, m)))


@lru_cache(maxsize=256)
def _unit_idle(name: str, p: int, m: int) -> float:
    """The busiest rank's idle time of the table played with F = B = W = 1 per chunk."""
    return max(idle_per_rank(play(name, p, steady_micro_batches(p, m), 1.0, 1.0, 1.0)))


def zero_bubble_idle_s(name: str, p: int, m: int, per_micro_batch_s: float) -> float:
    """Idle time per step of a zero-bubble schedule whose stage takes ``per_micro_batch_s`` per micro-batch,
    split as F = B = W (a third each: the backward twice the forward, half of it the input gradient); a
    ZB-V chunk is half the stage. ZB-H1 gives the closed form (p - 1)(F + B - W)."""
    chunks = SCHEDULES[name][1]
    return _unit_idle(name, p, m) * per_micro_batch_s / (3 * chunks)
