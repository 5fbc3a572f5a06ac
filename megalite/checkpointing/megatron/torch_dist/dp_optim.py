"""The distributed optimizer's ``dp_reshardable`` torch_dist state (Megatron-LM's default) per parameter.

That sharding saves each gradient bucket's state flat, as megatron-core's buffer lays it out, under
``[chained_<i>.]optimizer.distributed.dp_group_idx_G.gbuf_idx_B.dtype_(..).bucket_idx_K.{param,exp_avg,exp_avg_sq}``:
one tensor per bucket of its unpadded size, in bucket coordinates (each DP rank's contiguous slice is a chunk
of it, so the DP split needs no undoing). ``G`` is the rank in the tensor x pipeline group (the expert
optimizer of an MoE run: in the expert tensor x expert x pipeline group), ``B`` the model chunk's buffer
(torch_dist/dp_stages.py says which parameters each holds). The layout is rebuilt from the checkpoint alone
(buffer.py, shared with the legacy ``distrib_optim.pt``): a buffer's parameters (the model keys, the
TP cut of each) walked in reverse of megatron-core's parameter order, each start rounded up to 64 elements, a
bucket ending exactly where its saved size ends. Every bucket must be filled exactly and agree with the saved
``per_bucket_numel_unpadded``, and a replicated parameter's state must be the same on every TP rank; a state
that does not fit (the legacy GroupedMLP's merged experts, mixed dtypes: more buffers per chunk) is not
read, and why is returned. Transformer Engine's spec (``transformer_impl`` in the args) orders each layer's
parameters its own way (``LAYER_TE``), and its grouped experts (``moe_grouped_gemm``) theirs
(torch_dist/dp_stages.py); multi-latent attention's layers (``multi_latent_attention`` in the args) have
theirs (``LAYER_MLA``, ``LAYER_MLA_TE``), and multi-token prediction depths (``mtp.layers.K.*``) lie between
the final norm and the output layer (at PP > 1 after the last stage's copy of the word embedding, which they
need: untied only). Layers keyed one by one (a model of dense and MoE layers) and stacked over layers are both read; the
router's expert bias is a buffer, with no state. The fp32 main parameters must equal the weights (read.py
checks), so an order that is not megatron-core's is refused, not read wrong.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.megatron.buffer import (
    DENSE_OPTIMIZER,
    EP_OPTIMIZER,
    FIELDS,
    Placed,
    group_steps,
    optimizer_kind,
    place_buffer,
)
from megalite.checkpointing.megatron.names import BUFFERS, SKIPPED
from megalite.checkpointing.megatron.torch_dist.dp_stages import (
    LAYER_OF,
    Experts,
    Param,
    chunk_params,
    expert_hosts,
    expert_params,
    local_experts,
    split_expert_keys,
    stage_layers,
    with_experts,
)
from megalite.checkpointing.megatron.tp import DOWN_PROJ, join_tp, tp_dim, whole_rows

BUCKET = re.compile(r"^(chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                    r"\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$")
# megatron-core's parameter registration order (GPTModel, local spec): the buffer holds it reversed. The
# local spec saves its norms under the fused names as well, so both names share a slot.
FIRST = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
LAYER = (("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
         ("input_layernorm.bias", "self_attention.linear_qkv.layer_norm_bias"),
         ("self_attention.linear_proj.weight",), ("self_attention.linear_proj.bias",),
         ("self_attention.linear_qkv.weight",), ("self_attention.linear_qkv.bias",),
         ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
         ("pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias"),
         ("mlp.linear_fc1.weight",), ("mlp.linear_fc1.bias",), ("mlp.linear_fc2.weight",), ("mlp.linear_fc2.bias",),
         ("mlp.router.weight",), ("mlp.router.bias",),  # an MoE layer's: the routed experts (EP 1) go here
         ("mlp.shared_experts.linear_fc1.weight",), ("mlp.shared_experts.linear_fc1.bias",),
         ("mlp.shared_experts.linear_fc2.weight",), ("mlp.shared_experts.linear_fc2.bias",))
# Transformer Engine's spec: no input norm of its own (an identity) but the QKV GEMM's fused one, which
# te.pytorch.LayerNormLinear registers before its weight and bias, and the attention's projection comes first
# (megatron-core's Attention builds linear_proj before SelfAttention builds linear_qkv); the MLP's fused norm
# (or an MoE layer's TENorm pre_mlp_layernorm) sits where the local spec's pre-MLP norm does.
LAYER_TE = (LAYER[2], LAYER[3], LAYER[0], LAYER[1], *LAYER[4:])
# Multi-latent attention (megatron-core's MLASelfAttention, transformer/multi_latent_attention.py): the base
# Attention builds linear_proj (MLA's rebuild keeps its place), then MLASelfAttention linear_q_proj (no query
# compression) or linear_q_down_proj and linear_q_up_proj, linear_kv_down_proj, linear_kv_up_proj, and last the
# latent norms q_layernorm (with compression) and kv_layernorm; none of the projections has a bias. Both specs
# keep the input norm a module of its own (the local spec keys it unfused; Transformer Engine's is a TENorm), so
# it comes first. Transformer Engine's spec fuses the latent norms into the up-projections
# (TELayerNormColumnParallelLinear: its layer_norm_weight / _bias before its weight), keeps the down-projections
# whole on every TP rank (TELinear, "duplicated"), and its pre-MLP norm is placed as in LAYER_TE.
MLA_PROJ = (("self_attention.linear_q_proj.weight",), ("self_attention.linear_q_down_proj.weight",))
LAYER_MLA = (*LAYER[:4], *MLA_PROJ, ("self_attention.linear_q_up_proj.weight",),
             ("self_attention.linear_kv_down_proj.weight",), ("self_attention.linear_kv_up_proj.weight",),
             *((f"self_attention.{n}_layernorm.{w}",) for n in ("q", "kv") for w in ("weight", "bias")), *LAYER[6:])
FUSED = ("layer_norm_weight", "layer_norm_bias", "weight")
LAYER_MLA_TE = (*LAYER[:4], *MLA_PROJ, *((f"self_attention.linear_q_up_proj.{w}",) for w in FUSED),
                ("self_attention.linear_kv_down_proj.weight",),
                *((f"self_attention.linear_kv_up_proj.{w}",) for w in FUSED), *LAYER[6:])
FINAL = (("decoder.final_layernorm.weight", "decoder.final_norm.weight"),
         ("decoder.final_layernorm.bias", "decoder.final_norm.bias"))
# Multi-token prediction (transformer/multi_token_prediction.py): GPTModel registers its MTP block after the
# decoder (its final norm) and before the output layer; each depth's MultiTokenPredictionLayer builds enorm,
# hnorm, eh_proj (no bias), the transformer layer (the decoder's layer spec) and its final_layernorm.
MTP_KEY = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
MTP_HEAD = (("enorm.weight",), ("enorm.bias",), ("hnorm.weight",), ("hnorm.bias",), ("eh_proj.weight",))
MTP_TAIL = (("final_layernorm.weight",), ("final_layernorm.bias",))
LAST = (("output_layer.weight",),)
MTP_EMBEDDING = "mtp_stage.embedding.word_embeddings.weight"  # the last stage's copy at PP > 1 (not a key)


def _layer_order(te: bool, mla: bool) -> tuple[tuple[str, ...], ...]:
    """One transformer layer's parameter slots in megatron-core's order for its spec and attention."""
    return (LAYER_MLA_TE if te else LAYER_MLA) if mla else (LAYER_TE if te else LAYER)


def _slots(te: bool, mla: bool) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """(model key or per-layer suffix -> (part, slot), an MTP depth's suffix -> slot): the parts in
    megatron-core's registration order: embeddings, decoder layers, final norm, MTP depths, output layer."""
    layer = _layer_order(te, mla)
    slots: dict[str, tuple[int, int]] = {k: (0, i) for i, k in enumerate(FIRST)}
    slots.update({k: (1, i) for i, names in enumerate(layer) for k in names})
    slots.update({k: (2, i) for i, names in enumerate(FINAL) for k in names})
    slots.update({k: (4, i) for i, names in enumerate(LAST) for k in names})
    depth = [*MTP_HEAD, *(tuple(f"transformer_layer.{n}" for n in names) for names in layer), *MTP_TAIL]
    return slots, {k: i for i, names in enumerate(depth) for k in names}


def _ordered(src: Any, model_keys: Iterable[str], te: bool = False, mla: bool = False) -> list[Param] | str:
    """The model's parameters in megatron-core's order (of the local spec, or with ``te`` Transformer
    Engine's; ``mla``: multi-latent attention's layers), each per layer, with its full shape and cut (-1 for
    Transformer Engine's MLA down-projections, whole on every TP rank)."""
    slots, depth = _slots(te, mla)
    found: list[tuple[tuple[int, int, int], Param]] = []
    for key in model_keys:
        if SKIPPED.search(key) or BUFFERS.search(key):  # no parameter: Transformer Engine's extra state, buffers
            continue
        shape = src.shape(key)
        dim = -1 if te and DOWN_PROJ.search(key) else tp_dim(key)
        if (m := MTP_KEY.match(key)) is not None:
            if m[2] not in depth:
                return f"{key} has no known place in megatron-core's parameter order of a multi-token prediction depth"
            found.append(((3, int(m[1]), depth[m[2]]), (key, shape, dim)))
            continue
        if (m := LAYER_OF.match(key)) is not None:  # one layer's key (a model of dense and MoE layers)
            suffix = key[m.end():]
            if slots.get(suffix, (None,))[0] != 1:
                return f"{key} has no known place in megatron-core's parameter order"
            found.append(((1, int(m[1]), slots[suffix][1]), (key, shape, dim)))
            continue
        stacked = key.startswith("decoder.layers.")
        suffix = key[len("decoder.layers."):] if stacked else key
        if suffix not in slots:
            return f"{key} has no known place in megatron-core's parameter order"
        part, slot = slots[suffix]
        if not stacked:
            found.append(((part, 0, slot), (key, shape, dim)))
            continue
        found += [((1, i, slot), (f"decoder.layers.{i}.{suffix}", shape[1:], dim)) for i in range(shape[0])]
    found.sort(key=lambda item: item[0])
    if len({order for order, _ in found}) != len(found):
        return "two keys name the same parameter (a norm under both its names)"
    return [p for _, p in found]


def _place(params: list[Param], tp: int, sizes: list[int]) -> dict[str, tuple[int, int, tuple[int, ...]]] | str:
    """Per parameter (bucket, start in it, this rank's shape): each full shape cut over TP, the buffer walked
    in reverse order."""
    shapes = []
    for name, shape, dim in reversed(params):
        local = list(shape)
        if dim >= 0:
            if shape[dim] % tp:
                return f"{name}'s {shape} does not split over TP {tp}"
            local[dim] //= tp
        shapes.append((name, tuple(local)))
    return place_buffer(shapes, sizes)


Buffers = dict[int, dict[str, dict[int, str]]]  # gbuf_idx -> field -> bucket index -> key
Job = tuple[str, int, int, int, int, Placed]  # key prefix, dp group, gbuf, TP rank, TP size, its placed parameters
Saved = dict[str, dict[int, list[dict[str, Any]]]]  # key prefix -> dp group -> its saved param groups


def _buckets(keys: Iterable[str]) -> dict[str, dict[int, Buffers]] | str:
    """Optimizer key prefix ('' or 'chained_<i>.') -> dp_group_idx -> its buffers."""
    out: dict[str, dict[int, Buffers]] = {}
    for key in keys:
        m = BUCKET.match(key)
        if m is None:
            continue
        group = out.setdefault(m[1] or "", {}).setdefault(int(m[2]), {})
        group.setdefault(int(m[3]), {}).setdefault(FIELDS[m[6]], {})[int(m[5])] = key
    return out or "no bucket tensors"


def _unwrap(obj: Any) -> Any:
    while isinstance(obj, list) and len(obj) == 1:
        obj = obj[0]
    return obj


def _param_groups(src: Any, groups: dict[str, dict[int, Buffers]]) -> Saved:
    """Each dp group's saved param groups (each with its step and is_expert_parallel)."""
    out: Saved = {}
    for prefix, per in groups.items():
        for g in per:
            saved = _unwrap(src.object(f"{prefix}optimizer.distributed.dp_group_idx_{g}.optimizer"))
            found = saved.get("param_groups") if isinstance(saved, dict) else None
            out.setdefault(prefix, {})[g] = [p for p in found or [] if isinstance(p, dict)]
    return out


def _chains(saved: Saved) -> dict[str, str] | str:
    """'dense' (and 'expert') -> its optimizer's key prefix, each optimizer's kind from its param groups'
    ``is_expert_parallel`` (megatron_buffer.optimizer_kind)."""
    kinds: dict[str, str] = {}
    for prefix, per in sorted(saved.items()):
        position = int(prefix[len("chained_"):-1]) if prefix else 0
        kind = optimizer_kind([p for ps in per.values() for p in ps], position)
        if kind is None:
            return f"the {prefix or 'only '}optimizer's saved param groups are missing or not all dense or all expert"
        if kind in kinds:
            return f"it holds two {kind} optimizers ({kinds[kind] or 'unprefixed'}, {prefix}), which is not read"
        kinds[kind] = prefix
    return kinds if DENSE_OPTIMIZER in kinds else "it holds no dense parameters' optimizer"


def _step(saved: Saved) -> float | str:
    """Adam's one step count: every param group of every optimizer (dense and expert) must hold the same
    (megatron-core's ChainedOptimizer makes them equal before it saves)."""
    steps = set().union(*(group_steps({"param_groups": ps}) for per in saved.values() for ps in per.values()))
    if len(steps) != 1 or min(steps) < 0:
        return f"its optimizers' param groups hold no single step count ({sorted(steps)[:4]})"
    return steps.pop()


def _group_sizes(src: Any, prefix: str, group: int, buffers: Buffers) -> list[list[int]] | str:
    """Each buffer's bucket sizes of one dp group, checked against its saved per_bucket_numel_unpadded."""
    where = f"{prefix}optimizer.distributed.dp_group_idx_{group}"
    if sorted(buffers) != list(range(len(buffers))):
        return f"{where}'s buffers {sorted(buffers)} are not numbered 0..n"
    sizes = []
    for b in range(len(buffers)):
        if sorted(buffers[b]) != sorted(FIELDS.values()):
            return f"{where}.gbuf_idx_{b} holds the fields {sorted(buffers[b])}, not param, exp_avg and exp_avg_sq"
        keys = buffers[b].get("exp_avg", {})
        if sorted(keys) != list(range(len(keys))) or any(sorted(f) != sorted(keys) for f in buffers[b].values()):
            return f"{where}.gbuf_idx_{b}'s buckets are not numbered 0..n for every field"
        sizes.append([src.shape(keys[k])[0] for k in range(len(keys))])
    saved = _unwrap(src.object(f"{where}.per_bucket_numel_unpadded"))
    saved = [saved] if isinstance(saved, dict) else saved
    got = [list(next(iter(d.values()))) if isinstance(d, dict) and len(d) == 1 else None for d in saved or []]
    if got != sizes:
        return f"{where}'s per_bucket_numel_unpadded {saved!r:.80} is not its buckets' sizes {sizes}"
    return sizes


def _all_sizes(src: Any, prefix: str, groups: dict[int, Buffers], count: int, chunks: int, what: str
               ) -> list[list[list[int]]] | str:
    """Per dp group 0..count-1, per model chunk, its bucket sizes: one buffer per chunk."""
    if sorted(groups) != list(range(count)):
        return f"its {what} optimizer's dp groups {sorted(groups)} are not numbered 0..{count - 1}"
    out = []
    for g in range(count):
        sizes = _group_sizes(src, prefix, g, groups[g])
        if isinstance(sizes, str):
            return sizes
        if len(sizes) != chunks:
            return (f"{prefix}optimizer.distributed.dp_group_idx_{g} holds {len(sizes)} buffers, not one per model "
                    f"chunk ({chunks}): more than one gradient buffer per chunk (mixed dtypes) is not read")
        out.append(sizes)
    return out


def _layout(args: Any, groups: dict[str, dict[int, Buffers]], chains: dict[str, str]) -> dict[str, int] | str:
    """The parallel sizes: TP, model chunks per stage and expert TP from the args; PP and EP from the dp groups
    (the dense optimizer's count TP x PP, the expert optimizer's expert TP x EP x PP)."""
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    etp = int(getattr(args, "expert_tensor_parallel_size", None) or tp)
    dense = len(groups[chains[DENSE_OPTIMIZER]])
    pp = dense // tp
    experts = len(groups[chains[EP_OPTIMIZER]]) if EP_OPTIMIZER in chains else etp * pp
    if not pp or dense % tp or experts % (etp * pp):
        return (f"its {dense} dense and {experts} expert dp groups do not divide by its args' TP {tp} and expert TP "
                f"{etp} (not megatron-core's layout)")
    return {"tp": tp, "pp": pp, "vp": int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1),
            "ep": experts // (etp * pp), "etp": etp}


def _dense_jobs(src: Any, prefix: str, groups: dict[int, Buffers], dense: list[Param],
                copies: tuple[Param | None, Param | None], lay: dict[str, int], num_layers: int
                ) -> tuple[list[Job], dict[tuple[int, int], range]] | str:
    """Every dense dp group's buffers placed (``copies``: the last stage's copy of the embedding as a tied
    output layer, or as the MTP depths' embedding), and each (stage, chunk)'s layers (found on TP rank 0's)."""
    tp, pp, vp = lay["tp"], lay["pp"], lay["vp"]
    sizes = _all_sizes(src, prefix, groups, tp * pp, vp, "dense")
    if isinstance(sizes, str):
        return sizes

    def params(p: int, c: int, layers: range) -> list[Param]:
        return chunk_params(dense, layers, p == 0 and c == 0, p == pp - 1 and c == vp - 1, *copies)

    layers = stage_layers(lambda p, c, r: isinstance(_place(params(p, c, r), tp, sizes[tp * p][c]), dict),
                          num_layers, pp, vp)
    if isinstance(layers, str):
        return layers
    jobs: list[Job] = []
    for g in range(tp * pp):
        for c in range(vp):
            placed = _place(params(g // tp, c, layers[g // tp, c]), tp, sizes[g][c])
            if isinstance(placed, str):
                return f"{prefix}dp_group_idx_{g}.gbuf_idx_{c}: {placed}"
            jobs.append((prefix, g, c, g % tp, tp, placed))
    return jobs, layers


def _expert_jobs(src: Any, prefix: str, groups: dict[int, Buffers], experts: Experts,
                 layers: dict[tuple[int, int], range], lay: dict[str, int]) -> list[Job] | str:
    """Every expert dp group's buffers placed: G = etp + ETP·(ep + EP·pp), the chunk's layers' local experts."""
    etp, ep, pp, vp = lay["etp"], lay["ep"], lay["pp"], lay["vp"]
    sizes = _all_sizes(src, prefix, groups, etp * ep * pp, vp, "expert")
    if isinstance(sizes, str):
        return sizes
    jobs: list[Job] = []
    for g in range(etp * ep * pp):
        for c in range(vp):
            p = g // (etp * ep)
            hosts = expert_hosts(experts, layers[p, c], p == pp - 1 and c == vp - 1)
            params = local_experts(experts, hosts, g // etp % ep, ep)
            placed = _place(params, etp, sizes[g][c])
            if isinstance(placed, str):
                return f"{prefix}dp_group_idx_{g}.gbuf_idx_{c}: {placed}"
            jobs.append((prefix, g, c, g % etp, etp, placed))
    return jobs


def _read(src: Any, jobs: list[Job], groups: dict[str, dict[int, Buffers]], swiglu: bool,
          whole: dict[str, int] | None = None) -> dict[str, dict[str, torch.Tensor]] | str:
    """field -> name -> the full state, each placed parameter's slices read from its buckets, joined over TP
    (``whole``: MLA's down-projections' full rows, tp.whole_rows: Transformer Engine's are replicated)."""
    shards: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    tp_of: dict[str, int] = {}
    for prefix, g, c, t, tp, placed in jobs:
        for field, keys in groups[prefix][g][c].items():
            flat = [src.tensor(keys[b]) for b in range(len(keys))]
            for name, (b, start, shape) in placed.items():
                per = shards.setdefault(field, {}).setdefault(name, {})
                if t in per:
                    return f"{name} lies in two buffers of TP rank {t}"
                n = int(torch.Size(shape).numel())
                per[t], tp_of[name] = flat[b][start:start + n].view(shape).float(), tp
    missing = [n for per in shards.values() for n, ts in per.items() if sorted(ts) != list(range(tp_of[n]))]
    if missing:
        return f"{missing[0]} is not in the buffers of every one of its {tp_of[missing[0]]} TP ranks"
    try:  # a replicated parameter whose state differs between TP ranks: the layout is not megatron-core's
        return {f: {n: join_tp(n, [ts[t] for t in range(tp_of[n])], swiglu, f"optimizer {f}", whole)
                    for n, ts in per.items()} for f, per in shards.items()}
    except CheckpointError as e:
        return str(e)


def _grouped(args: Any) -> bool | str:
    """Whether the experts are Transformer Engine's grouped ones (megatron-core's TEGroupedMLP:
    ``transformer_impl transformer_engine`` with ``moe_grouped_gemm``), or why the spec is not read: another
    ``transformer_impl``, or the legacy GroupedMLP (the local spec's grouped GEMM, or
    ``moe_use_legacy_grouped_gemm``), whose ``weight1``/``weight2`` hold all of a layer's local experts in one
    tensor each."""
    impl = getattr(args, "transformer_impl", None)
    grouped = bool(getattr(args, "moe_grouped_gemm", False))
    if impl not in (None, "local", "transformer_engine"):
        return f"its layout is read for the local and Transformer Engine specs only (transformer_impl {impl})"
    if grouped and (impl != "transformer_engine" or getattr(args, "moe_use_legacy_grouped_gemm", False)):
        return (f"its experts are megatron-core's legacy GroupedMLP (transformer_impl {impl or 'local'}, "
                f"moe_grouped_gemm, moe_use_legacy_grouped_gemm {getattr(args, 'moe_use_legacy_grouped_gemm', False)}"
                f"), whose merged weight1/weight2 tensors are not read")
    return grouped


def _copies(src: Any, ordered: list[Param], args: Any, pp: int) -> tuple[Param | None, Param | None] | str:
    """The last stage's copies of the word embedding at PP > 1, megatron-core's shared embedding (alone in its
    bucket): (the tied output layer, registered last; the MTP depths' embedding, registered first: GPTModel
    builds its ``embedding`` on the MTP stage too, and there it is the shared weight); or why not laid out."""
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    if pp == 1:
        return None, None
    shape = src.shape("embedding.word_embeddings.weight")
    if not any(MTP_KEY.match(p[0]) for p in ordered):
        return (("output_layer.weight", shape, 0) if tied else None), None
    learned = any(p[0] == "embedding.position_embeddings.weight" for p in ordered)
    if tied or learned:
        what = " and ".join(w for w, on in (("a tied output layer", tied), ("learned positions", learned)) if on)
        return (f"its multi-token prediction depths at PP {pp} with {what} (more copies of the embeddings on the "
                "last stage) are not laid out")
    return None, (MTP_EMBEDDING, shape, 0)


def dp_reshardable_jobs(src: Any, model_keys: list[str], args: Any
                        ) -> tuple[list[Job], dict[str, dict[int, Buffers]], float] | str:
    """Every buffer's parameters placed (the dense and the expert optimizer's), the bucket keys and Adam's
    step; or why the state is not read."""
    grouped = _grouped(args)
    if isinstance(grouped, str):
        return grouped
    dense_keys, expert_keys = split_expert_keys(model_keys)
    te = getattr(args, "transformer_impl", None) == "transformer_engine"
    mla = bool(getattr(args, "multi_latent_attention", False))
    ordered, groups = _ordered(src, dense_keys, te, mla), _buckets(src.keys())
    experts = expert_params(src, expert_keys, grouped) if expert_keys else {}
    for got in (ordered, experts, groups):
        if isinstance(got, str):
            return got
    saved = _param_groups(src, groups)
    chains, step = _chains(saved), _step(saved)
    lay = chains if isinstance(chains, str) else _layout(args, groups, chains)
    if isinstance(lay, str) or isinstance(step, str):
        return lay if isinstance(lay, str) else str(step)
    copies = _copies(src, ordered, args, lay["pp"])
    if isinstance(copies, str):
        return copies
    split = EP_OPTIMIZER in chains  # megatron-core's expert optimizer (EP > 1); at EP 1 the experts are dense
    dense = ordered if split else with_experts(ordered, experts)
    if isinstance(dense, str):
        return dense
    if (split and not experts) or (experts and not split and lay["etp"] != lay["tp"]):
        return (f"it holds {'an' if split else 'no'} expert optimizer for {len(experts)} MoE layers at TP "
                f"{lay['tp']}, expert TP {lay['etp']} (not megatron-core's layout)")
    num_layers = 1 + max((int(m[1]) for p in ordered if (m := LAYER_OF.match(p[0]))), default=-1)
    got = _dense_jobs(src, chains[DENSE_OPTIMIZER], groups[chains[DENSE_OPTIMIZER]], dense, copies, lay, num_layers)
    if isinstance(got, str):
        return got
    jobs, layers = got
    if split:
        more = _expert_jobs(src, chains[EP_OPTIMIZER], groups[chains[EP_OPTIMIZER]], experts, layers, lay)
        if isinstance(more, str):
            return more
        jobs += more
    return jobs, groups, step


def dp_reshardable_state(src: Any, model_keys: list[str], args: Any
                         ) -> tuple[dict[str, dict[str, torch.Tensor]], float] | str:
    """field (exp_avg, exp_avg_sq, main) -> megatron-core per-layer name -> full tensor, and Adam's step;
    or why the state is not read."""
    got = dp_reshardable_jobs(src, model_keys, args)
    if isinstance(got, str):
        return got
    jobs, groups, step = got
    out = _read(src, jobs, groups, bool(getattr(args, "swiglu", False)), whole_rows(args))
    if isinstance(out, str):
        return out
    for field, per in out.items():  # the MTP stage's copy of the embedding: the embedding's state, dropped
        copy = per.pop(MTP_EMBEDDING, None)
        if copy is not None and not torch.equal(copy, per["embedding.word_embeddings.weight"]):
            return f"the last stage's copy of the word embedding holds other {field} than the embedding"
    return out, step
