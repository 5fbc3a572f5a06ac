"""Zero-bubble schedules (zb-h1, zbv) in the plan: the bytes a deferred W keeps (docs/design.md §3.4) times
the schedule table's peak pending W's, and the idle time of the table played with the plan's F, B, W.

Pure arithmetic: the planner, the benches (split_backward_memory.py, bench_zero_bubble.py) and the tests
read the same formula.
"""

from __future__ import annotations

from functools import lru_cache

from megalite.config.model import ModelConfig
from megalite.pipeline.schedule_table import ScheduleSpec, build_tables
from megalite.pipeline.stages import StageMap
from megalite.pipeline.timeline import SCHEDULES, idle_per_rank, peak_pending_w, peak_pending_w_bytes, play, spec_for
from megalite.planning import mla

ZERO_BUBBLE = ("zb-h1", "zbv")


def layer_elements(cfg: ModelConfig, tokens: int, tp: int, sp: bool, moe: bool = False,
                   routed_rows: int | None = None) -> int:
    """Elements one transformer layer keeps for W: per GEMM its input and its output gradient.

    tokens = s·b. Column-parallel GEMMs (QKV, fc1) take the full input, or its 1/tp sequence shard with
    SP (all-gathered again in W), and give 1/tp of the outputs; row-parallel ones (proj, fc2) take 1/tp
    of the inputs and give the full output, whose gradient is whole on every rank. An MoE layer (``moe``)
    has no dense MLP: its experts' fc1 and fc2 keep the same per routed row (``expert_elements``) and its
    shared expert, if any, a dense MLP's."""
    h, d = cfg.hidden_size, cfg.kv_channels
    qkv_out = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * d
    col_in = h // tp if sp else h
    attention = col_in + qkv_out // tp + cfg.num_attention_heads * d // tp + h
    if cfg.multi_latent_attention:  # its latent projections' (planning/mla.py)
        attention = round(mla.w_elements(cfg, tp, sp))
    if not moe:
        return tokens * (attention + _mlp(cfg, cfg.ffn_hidden_size, col_in, tp))
    shared = cfg.moe_shared_expert_intermediate_size
    rows = tokens * cfg.moe_router_topk if routed_rows is None else routed_rows
    return tokens * (attention + (_mlp(cfg, shared, col_in, tp) if shared else 0)) + expert_elements(cfg, rows)


def _mlp(cfg: ModelConfig, ffn: int, col_in: int, tp: int) -> int:
    """Per token, a dense MLP of width ``ffn``: fc1's input and output gradient, fc2's."""
    return col_in + (2 * ffn if cfg.gated_linear_unit else ffn) // tp + ffn // tp + cfg.hidden_size


def expert_elements(cfg: ModelConfig, rows: int, etp: int = 1) -> int:
    """The routed experts' of one MoE layer: the rows its local experts received (s·b·k with EP = 1 and no
    capacity drop; with EP, what the dispatch brought, which depends on the routing), each keeping fc1's
    input (h) and output gradient (f₁/etp) and fc2's input (f/etp) and output gradient (h)."""
    f = cfg.expert_ffn_hidden_size
    return rows * (2 * cfg.hidden_size + ((2 * f if cfg.gated_linear_unit else f) + f) // etp)


def output_bytes(cfg: ModelConfig, tokens: int, padded_vocab: int, tp: int, sp: bool, element: int) -> int:
    """The output layer's: unfused, its input and the logits' gradient [s·b, v/tp]; fused with the
    cross-entropy, the per-token upstream gradient (fp32) and the fp32 partial weight gradient the fusion
    keeps anyway."""
    if cfg.cross_entropy_loss_fusion:
        return 4 * tokens + 4 * padded_vocab // tp * cfg.hidden_size
    col_in = cfg.hidden_size // tp if sp else cfg.hidden_size
    return element * tokens * (col_in + padded_vocab // tp)


def embedding_bytes(cfg: ModelConfig, tokens: int, element: int) -> int:
    """The word embedding's: the lookup's output gradient [s·b, h] (the whole sequence: the lookup runs
    before any sequence-parallel scatter) and its int64 ids."""
    return element * tokens * cfg.hidden_size + 8 * tokens


def deferred_w_bytes(cfg: ModelConfig, layers: int, tokens: int, padded_vocab: int, tp: int = 1, sp: bool = False,
                     output: bool = True, element: int = 4, moe_layers: int = 0, embedding: bool = False) -> int:
    """One pending W of a stage holding ``layers`` layers, ``moe_layers`` of them MoE (and the output layer
    with ``output``, the word embedding with ``embedding``)."""
    total = element * (layers - moe_layers) * layer_elements(cfg, tokens, tp, sp)
    total += element * moe_layers * layer_elements(cfg, tokens, tp, sp, moe=True) if moe_layers else 0
    total += embedding_bytes(cfg, tokens, element) if embedding else 0
    return total + (output_bytes(cfg, tokens, padded_vocab, tp, sp, element) if output else 0)


def chunk_w_bytes(cfg: ModelConfig, stages: StageMap, rank: int, chunk: int, tokens: int, padded_vocab: int,
                  tp: int = 1, sp: bool = False, element: int = 4, layers: int | None = None) -> int:
    """One pending W of (rank, chunk): its ``layers`` layers' (default: the layers cut evenly over the virtual
    stages) and, on the first stage, the word embedding's. The output layer's weight gradient is not among
    them: it runs right after its B (``prompt_bytes``)."""
    layers = cfg.num_layers // (stages.last + 1) if layers is None else layers
    first = stages.stage(rank, chunk) == 0
    return deferred_w_bytes(cfg, layers, tokens, padded_vocab, tp, sp, False, element, embedding=first)


def prompt_bytes(cfg: ModelConfig, stages: StageMap, rank: int, chunk: int, tokens: int, padded_vocab: int,
                 tp: int = 1, sp: bool = False, element: int = 4) -> int:
    """What a B of (rank, chunk) keeps until just after it: the output layer's W bytes where the chunk holds
    the last stage (ZB-H1: the last rank; ZB-V: rank 0's chunk 1), run once B's input gradient is sent."""
    if stages.stage(rank, chunk) != stages.last:
        return 0
    return output_bytes(cfg, tokens, padded_vocab, tp, sp, element)


def peak_table_bytes(cfg: ModelConfig, spec: ScheduleSpec, rank: int, tokens: int, padded_vocab: int,
                     tp: int = 1, sp: bool = False, element: int = 4,
                     chunk_layers: tuple[int, ...] | None = None) -> int:
    """The most bytes rank ``rank``'s pending W's keep at once: its table played, each B adding and each W
    freeing its own chunk's ``chunk_w_bytes`` (``chunk_layers``: the rank's layers per chunk, from the run's
    split; default even), and the loss chunk's B adding its output layer's bytes for that moment only."""
    def one(chunk: int) -> int:
        n = None if chunk_layers is None else chunk_layers[chunk]
        return chunk_w_bytes(cfg, spec.stages, rank, chunk, tokens, padded_vocab, tp, sp, element, n)

    def prompt(chunk: int) -> int:
        return prompt_bytes(cfg, spec.stages, rank, chunk, tokens, padded_vocab, tp, sp, element)

    return peak_pending_w_bytes(_tables(spec)[rank], one, prompt)


@lru_cache(maxsize=64)
def _tables(spec: ScheduleSpec) -> tuple[tuple, ...]:
    return tuple(tuple(t) for t in build_tables(spec))


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


@lru_cache(maxsize=1024)
def zero_bubble_unit_idle(name: str, p: int, m: int, holds: tuple[int, ...] | None = None) -> float:
    """The busiest rank's idle time of the table played with F = B = W = 1 per chunk (``holds``:
    ScheduleSpec.holds)."""
    return max(idle_per_rank(play(name, p, steady_micro_batches(p, m), 1.0, 1.0, 1.0, holds=holds)))


def zero_bubble_idle_s(name: str, p: int, m: int, per_micro_batch_s: float,
                       holds: tuple[int, ...] | None = None) -> float:
    """Idle time per step of a zero-bubble schedule whose stage takes ``per_micro_batch_s`` per micro-batch,
    split as F = B = W (a third each: the backward twice the forward, half of it the input gradient); a
    ZB-V chunk is half the stage. ZB-H1 gives the closed form (p - 1)(F + B - W) at its own holds; ``holds``
    (ScheduleSpec.holds, as training runs them: planning/zero_bubble_memory.py) may lengthen it."""
    chunks = SCHEDULES[name][1]
    return zero_bubble_unit_idle(name, p, m, holds) * per_micro_batch_s / (3 * chunks)
