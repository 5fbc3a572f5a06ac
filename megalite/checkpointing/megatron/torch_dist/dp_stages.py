"""Which parameters each distributed-optimizer buffer holds: pipeline stages, model chunks and MoE experts.

torch_dist/dp_optim.py reads the ``dp_reshardable`` buffers; this module says what lies in each, from
megatron-core's source (0.16):

- ``get_megatron_optimizer`` puts the dense parameters in one DistributedOptimizer whose
  ``data_parallel_group_idx`` is the rank in the model-parallel (TP x PP) group, and, with EP > 1, the expert
  parameters (``allreduce`` False) in a second one, indexed by the rank in the expert TP x EP x PP group; a
  ChainedOptimizer of several prefixes their keys ``chained_<i>.`` and each saved param group carries
  ``is_expert_parallel``. Its rank generator orders TP fastest, then EP, then PP, so ``G = tp + TP·pp`` and
  ``G = etp + ETP·(ep + EP·pp)``. At EP 1 the experts are dense parameters, in the dense buffer.
- Each model chunk has its own DistributedDataParallel and buffers; ``gbuf_idx`` counts chunk 0's
  buffers, then chunk 1's: one per chunk when all parameters share a dtype. Chunk c of stage p is virtual
  stage c·PP + p; the first virtual stage holds the embeddings, the last the final norm and the output
  layer, which with a tied embedding and PP > 1 is a parameter of its own (the embedding's copy). With
  multi-token prediction at PP > 1 the last stage builds an ``embedding`` too (the depths embed the next
  tokens), registered first, and that copy is the shared weight (GPTModel.shared_embedding_or_output_weight):
  alone in its bucket, like the tied output layer.
- A stage's layers follow those of the virtual stages before it. How many it holds is found by fitting
  its buffers: every layer adds elements, so exactly one count fills a stage's buckets exactly (no
  pipeline-split flag needed, uneven stages included).
- EP rank e's local expert j is expert e·E/EP + j; SequentialMLP registers each expert's fc1 then fc2,
  after the router and before the shared expert. An MoE layer is named by its module prefix: a decoder
  layer's ``decoder.layers.{i}`` or a multi-token prediction depth's ``mtp.layers.{k}.transformer_layer``
  (GPTModel registers its MTP block after the decoder, on the last stage, so its experts follow the last
  stage's decoder layers' in the expert buffer).
- Transformer Engine's grouped experts: ``TEGroupedMLP`` (transformer/moe/experts.py), megatron-core's choice
  for ``moe_grouped_gemm`` with ``transformer_impl transformer_engine`` unless ``moe_use_legacy_grouped_gemm``
  (extensions/transformer_engine_spec_provider.py, ``grouped_mlp_modules``), builds ``linear_fc1`` then
  ``linear_fc2`` as TE ``GroupedLinear`` modules (``TEColumnParallelGroupedLinear`` /
  ``TERowParallelGroupedLinear``, extensions/transformer_engine.py), and Transformer Engine's
  ``GroupedLinear.__init__`` (transformer_engine/pytorch/module/grouped_linear.py) registers one
  ``weight{i}`` per local expert in turn (each followed by its ``bias{i}`` when biased): so a layer holds
  all its local experts' fc1 weights, then all their fc2 weights. Their torch_dist keys are SequentialMLP's
  (``_sharded_state_dict_grouped`` and ``TEGroupedMLP.sharded_state_dict`` map ``weight{i}`` to the stacked
  expert key on the global expert's offset, ``ep_rank * num_local_experts + i``), their shapes and TP cuts
  the same.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from megalite.checkpointing.megatron.tp import tp_dim

Param = tuple[str, tuple[int, ...], int]  # per-layer name, full shape, cut dim (-1: replicated)
LAYER_OF = re.compile(r"^decoder\.layers\.(\d+)\.")
# torch_dist's experts of the local spec (SequentialMLP): one key per fc, stacked over layers and experts
# ([L, E, ...]), or per layer ([E, ...]: a model of dense and MoE layers keys each layer apart, and an MTP
# depth's layer is its own); the host is the layer's module prefix
EXPERTS = re.compile(r"^(?P<host>decoder\.layers(?:\.\d+)?|mtp\.layers\.\d+\.transformer_layer)"
                     r"\.mlp\.experts\.experts\.linear_(?P<fc>fc[12])\.weight$")
MTP_HOST = re.compile(r"^mtp\.layers\.(\d+)\.transformer_layer$")


def split_expert_keys(model_keys: Iterable[str]) -> tuple[list[str], list[str]]:
    """(the other model keys, the routed experts' stacked keys)."""
    keys = list(model_keys)
    return [k for k in keys if not EXPERTS.match(k)], [k for k in keys if EXPERTS.match(k)]


Experts = dict[str, list[tuple[int, Param]]]  # a layer's module prefix -> [(global expert, its Param)]


def expert_params(src: Any, expert_keys: list[str], grouped: bool = False) -> Experts | str:
    """Each MoE layer's experts (by its module prefix, ``decoder.layers.{i}`` or an MTP depth's
    ``mtp.layers.{k}.transformer_layer``) in megatron-core's order, from the stacked keys: per expert its fc1
    and fc2 (SequentialMLP), or with ``grouped`` every expert's fc1, then every fc2 (TEGroupedMLP; an EP
    rank's local experts keep this order)."""
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    for k in expert_keys:
        m = EXPERTS.match(k)
        shapes.setdefault(m["host"], {})[m["fc"]] = tuple(src.shape(k))
    out: Experts = {}
    for host, per in shapes.items():
        lead = 2 if host == "decoder.layers" else 1  # [L, E, ...] stacked over layers, else [E, ...]
        if sorted(per) != ["fc1", "fc2"] or per["fc1"][:lead] != per["fc2"][:lead] or len(per["fc1"]) < lead + 2:
            return f"its expert keys of {host} are not fc1 and fc2 stacked over the same layers and experts"
        experts = per["fc1"][lead - 1]
        pairs = [(e, fc) for fc in ("fc1", "fc2") for e in range(experts)] if grouped else \
            [(e, fc) for e in range(experts) for fc in ("fc1", "fc2")]
        for layer in [f"{host}.{i}" for i in range(per["fc1"][0])] if lead == 2 else [host]:
            for e, fc in pairs:
                name = f"{layer}.mlp.experts.local_experts.{e}.linear_{fc}.weight"
                out.setdefault(layer, []).append((e, (name, per[fc][lead:], tp_dim(name))))
    return out


def with_experts(ordered: list[Param], experts: Experts) -> list[Param] | str:
    """The dense order with every expert in it (EP 1: they are dense parameters), each layer's after its
    router."""
    out, placed = [], set()
    for k, p in enumerate(ordered):
        out.append(p)
        host = p[0].partition(".mlp.router.")[0] if ".mlp.router." in p[0] else None
        nxt = ordered[k + 1][0] if k + 1 < len(ordered) else ""
        if host is not None and not nxt.startswith(f"{host}.mlp.router."):
            out += [q for _, q in experts.get(host, [])]
            placed.add(host)
    if not set(experts) <= placed:
        return f"layers {sorted(set(experts) - placed)} have experts but no router"
    return out


def expert_hosts(experts: Experts, layers: range, last: bool) -> list[str]:
    """The MoE layers of a model chunk holding decoder ``layers`` (and, if ``last``, the MTP depths, which
    megatron-core registers after the decoder) in megatron-core's order."""
    depths = sorted((int(m[1]), h) for h in experts if (m := MTP_HOST.match(h)))
    return [f"decoder.layers.{i}" for i in layers] + ([h for _, h in depths] if last else [])


def chunk_params(ordered: list[Param], layers: range, first: bool, last: bool, tied: Param | None,
                 lead: Param | None = None) -> list[Param]:
    """One model chunk's parameters in order: the embeddings on the first virtual stage, its layers, the
    final norm (MTP depths) and output layer on the last (``tied``: the embedding's copy after them; ``lead``:
    the embedding's copy before them, which the MTP depths need there)."""
    out = []
    for p in ordered:
        m = LAYER_OF.match(p[0])
        if m:
            keep = int(m[1]) in layers
        else:
            keep = first if p[0].startswith("embedding.") else last
        if keep:
            out.append(p)
    if last and lead is not None:
        out = [lead, *out]
    return out + [tied] if last and tied is not None else out


def local_experts(experts: Experts, hosts: list[str], ep_rank: int, ep: int) -> list[Param]:
    """The experts one EP rank holds on a chunk's MoE layers (``expert_hosts``), in order."""
    total = len({e for per in experts.values() for e, _ in per})
    mine = range(ep_rank * total // ep, (ep_rank + 1) * total // ep)
    return [p for h in hosts for e, p in experts.get(h, []) if e in mine]


def stage_layers(fits: Callable[[int, int, range], bool], num_layers: int, pp: int, vp: int
                 ) -> dict[tuple[int, int], range] | str:
    """(stage, chunk) -> its global layers: virtual stages in order, each holding the one count of layers
    with which ``fits(stage, chunk, layers)`` fills its buffers (the last one holds the rest)."""
    out, start = {}, 0
    for v in range(pp * vp):
        p, c = v % pp, v // pp
        options = [num_layers - start] if v == pp * vp - 1 else range(num_layers - start + 1)
        counts = [n for n in options if fits(p, c, range(start, start + n))]
        if len(counts) != 1:
            return (f"{'no' if not counts else 'more than one'} count of layers fills the buffers of pipeline "
                    f"stage {p}, model chunk {c} (from layer {start}; megatron-core's layout not matched)")
        out[p, c] = range(start, start + counts[0])
        start += counts[0]
    return out
