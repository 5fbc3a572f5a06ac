"""Step time on a cluster, one function per term (docs/planning.md).

compute = each micro-batch's GEMMs and attention on one rank, timed by their shapes (planning/kernels.py);
the memory-bound work (bytes the elementwise work moves / achievable device-memory bandwidth); the
optimizer step (bytes it moves); the bubble (p - 1)/v micro-batch times of a stage; communication = bytes
a rank puts on its link (ring algorithms: all-reduce 2(n-1)/n of the buffer, reduce-scatter and
all-gather (n-1)/n each) / the bandwidth of the link the group actually uses (NVLink inside a node, the
network across nodes, from the rank order and the node size), counted exposed unless it is overlapped:
the DP gradient reduction with --overlap-grad-reduce, except its last bucket; the parameter all-gather
with --overlap-param-gather; TP only when planned as Megatron's --tp-comm-overlap runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megalite.planning import mla
from megalite.planning.eager import dropout_mask_s, eager_scores_s, op_overhead_s
from megalite.planning.flops import training_flops
from megalite.planning.hardware import ClusterConfig
from megalite.planning.kernels import linear_s, stage_compute_s
from megalite.planning.memory import stage_dense_params, stage_expert_params, stage_layer_bytes, zero_bubble_holds
from megalite.planning.model_shape import EXPERT_FAMILY, LayerShape
from megalite.planning.moe import dispatch_comm_bytes
from megalite.planning.shape import RunShape
from megalite.planning.zero_bubble import ZERO_BUBBLE, zero_bubble_idle_s


def step_flops(sh: RunShape, with_recompute: bool) -> float:
    """The training loop's FLOPs per step over all ranks (megalite/planning/flops.py); with_recompute
    adds what recomputation runs again: a whole forward (full), the attention square's two matmuls
    (selective)."""
    m = sh.cfg.model
    tokens = sh.m * sh.b * sh.dp * sh.s
    flops = training_flops(m, sh.vocab, sh.s, tokens)
    if with_recompute:  # the forward again, for the share of the layers recomputed
        flops += sh.recomputed_share * (training_flops(m, sh.vocab, sh.s, tokens, recompute=True) - flops)
    if with_recompute and sh.recompute == "selective":
        core = mla.core_macs(m, sh.s) if m.multi_latent_attention else 2 * sh.s * m.num_attention_heads * m.kv_channels
        flops += tokens * m.num_layers * 2 * core
    return flops


def compute_s(sh: RunShape, cl: ClusterConfig) -> float:
    """One rank's GEMMs and attention for the step's m micro-batches (recomputation included): the busiest
    pipeline rank's, the output layer on the loss rank (kernels.stage_compute_s)."""
    return sh.m * stage_compute_s(sh, cl)


def memory_bound_s(sh: RunShape, cl: ClusterConfig) -> float:
    """Work bound by device-memory bandwidth rather than FLOPs (norms, dropouts, activations, residuals,
    the loss), on the pipeline rank with the most of it: every activation a layer keeps is written in
    forward and read in backward, and its gradient written and read (4x the layer's activation bytes);
    the cross-entropy makes 5 passes (read and write) over the fp32 logits, on the rank holding the loss; at
    the elementwise kernels' bandwidth (ClusterConfig.elementwise_bytes_per_s: the device memory's on a GPU)."""
    ce = 10 * sh.local_tokens * sh.padded_vocab / sh.tp * 4
    per_mb = max(4 * stage_layer_bytes(sh, r) + (ce if r == sh.loss_rank else 0.0) for r in range(sh.pp))
    return sh.m * per_mb / cl.elementwise_bytes_per_s()


OPTIMIZER_BYTES = 34  # Adam, per parameter (optimizer_s)


def state_stage(sh: RunShape) -> int:
    """The pipeline rank whose gradients and optimizer step the step waits for: rank 0 under an even split
    (as planned so far), the rank with the most dense parameters under an uneven one (a lighter first
    stage does not shorten the others' optimizer step)."""
    if sh.split.even or sh.pp == 1:
        return 0
    return max(range(sh.pp), key=lambda r: (stage_dense_params(sh, r), -r))


def optimizer_s(sh: RunShape, cl: ClusterConfig) -> float:
    """The optimizer step, bound by the bytes it moves per parameter the rank updates (its shard with
    the distributed optimizer / ZeRO): the fp32 gradient read, the fp32 main parameter and two Adam
    moments read and written, the 16-bit weight written (34 bytes; 32 in fp32)."""
    stage = state_stage(sh)
    n = stage_dense_params(sh, stage)
    shards = sh.dp * sh.cp if sh.cfg.ddp.shards_optimizer else 1
    per = OPTIMIZER_BYTES if sh.param_bytes == 2 else 32
    experts = stage_expert_params(sh, stage) / (sh.edp if sh.cfg.ddp.shards_optimizer else 1) \
        if EXPERT_FAMILY in sh.families else 0.0
    return (n / shards + experts) * per / cl.hbm_bytes_per_s()


def busy_per_micro_batch_s(sh: RunShape, cl: ClusterConfig) -> float:
    """A stage's time for one micro-batch forward and backward: what the pipeline's fill and drain cost
    per step of the schedule."""
    eager = op_overhead_s(sh, cl) + dropout_mask_s(sh, cl) + eager_scores_s(sh, cl)  # 0 on the GPU presets
    return (compute_s(sh, cl) + memory_bound_s(sh, cl) + tp_comm_s(sh, cl) + cp_comm_s(sh, cl) + eager) / sh.m


def bubble_s(sh: RunShape, cl: ClusterConfig) -> float:
    """Idle time of the pipeline schedule: (p - 1)/v micro-batch times of a stage (GPipe: p - 1); zb-h1 and
    zbv: their table played with the stage's F = B = W (planning/zero_bubble.py)."""
    name = sh.cfg.parallel.pipeline_schedule
    if name in ZERO_BUBBLE and sh.pp > 1:
        return zero_bubble_idle_s(name, sh.pp, sh.m, busy_per_micro_batch_s(sh, cl), zero_bubble_holds(sh))
    v = 1 if name == "gpipe" else sh.v
    return busy_per_micro_batch_s(sh, cl) * (sh.pp - 1) / v


# ---- which link a group uses -----------------------------------------------------------------------------
EXPERT_STRIDES = {"etp": lambda sh: 1, "emp": lambda sh: 1, "ep": lambda sh: sh.etp, "edp": lambda sh: sh.etp * sh.ep}
# a2a+p2p's sub-groups of CP: consecutive CP ranks, and those a2a apart
CP_SUB_STRIDES = {"cp_a2a": lambda sh: axis_stride(sh, "cp"), "cp_ring": lambda sh: axis_stride(sh, "cp") * sh.cp_a2a}


def axis_stride(sh: RunShape, axis: str) -> int:
    """Distance between consecutive ranks of a group of ``axis``. A stage's ranks are consecutive (MoE
    needs the default rank order) and cut expert-TP fastest, then EP, then expert-DP."""
    if axis in EXPERT_STRIDES:
        return EXPERT_STRIDES[axis](sh)
    if axis in CP_SUB_STRIDES:
        return CP_SUB_STRIDES[axis](sh)
    sizes = {"tp": sh.tp, "cp": sh.cp, "dp": sh.dp, "pp": sh.pp}
    stride = 1
    for a in sh.cfg.parallel.layout_order.split("-"):
        if a == axis:
            return stride
        stride *= sizes[a]
    raise ValueError(axis)


def crosses_nodes(sh: RunShape, cl: ClusterConfig, axis: str, size: int) -> bool:
    """Whether a group of ``axis`` spans nodes: its ranks lie ``stride`` apart and nodes hold
    gpus_per_node consecutive ranks (parallel/layout.py's node mapping)."""
    return size > 1 and axis_stride(sh, axis) * size > cl.gpus_per_node


def ranks_per_node_in_group(sh: RunShape, cl: ClusterConfig, axis: str, size: int) -> int:
    return max(1, min(size, cl.gpus_per_node // axis_stride(sh, axis)))


def dp_cp_ranks_per_node(sh: RunShape, cl: ClusterConfig) -> int:
    """The DP x CP group's ranks on the first node: CP's ranks there for each DP rank there (the two axes lie
    their own strides apart, and need not be neighbours in the rank order: tp-cp-pp-dp)."""
    node, s_cp, s_dp = cl.gpus_per_node, axis_stride(sh, "cp"), axis_stride(sh, "dp")
    count = 0
    for j in range(sh.dp):
        if j * s_dp >= node:
            break
        count += min(sh.cp, -(-(node - j * s_dp) // s_cp))
    return max(count, 1)


def link(sh: RunShape, cl: ClusterConfig, axis: str, size: int) -> float:
    """A point-to-point or all-to-all exchange's bandwidth per rank: each rank on its own link."""
    return cl.link_bytes_per_s(crosses_nodes(sh, cl, axis, size))


def ring_bytes_per_s(cl: ClusterConfig, inter: bool, k: int) -> float:
    """A ring collective's bandwidth per rank over a group with ``k`` ranks on each node. Across nodes NCCL
    runs one ring per channel, and each ring enters and leaves a node once, through the NIC of one of the
    group's ranks there: a node's network traffic is one rank's bytes spread over its k ranks' NICs (NCCL's
    multi-node rings reach the node's aggregate NIC bandwidth, not one NIC's). So a rank's bytes move at k
    NICs' bandwidth, never faster than NVLink carries them between the node's ranks."""
    if not inter:
        return cl.link_bytes_per_s(False)
    return min(k * cl.link_bytes_per_s(True), cl.link_bytes_per_s(False))


def ring_link(sh: RunShape, cl: ClusterConfig, axis: str, size: int) -> float:
    """ring_bytes_per_s for a group of ``axis``."""
    return ring_bytes_per_s(cl, crosses_nodes(sh, cl, axis, size), ranks_per_node_in_group(sh, cl, axis, size))


def ring_latency_s(sh: RunShape, cl: ClusterConfig, axis: str, size: int, all_reduce: bool = False,
                   per_node: int | None = None) -> float:
    """One ring collective's latency over a group of ``axis`` by NCCL's cost model (hardware.py): a base
    plus a step's latency per step, n - 1 steps of which nodes - 1 cross nodes (twice for an all-reduce);
    what makes many small collectives (ZeRO-3's per layer, a large group's) cost more than their bytes."""
    lat = cl.spec().ring_latency_us
    if size <= 1 or lat is None:
        return 0.0
    base, intra, inter = lat
    nodes = -(-size // (per_node or ranks_per_node_in_group(sh, cl, axis, size)))
    return (base + (2 if all_reduce else 1) * ((size - nodes) * intra + (nodes - 1) * inter)) * 1e-6


# ---- communication terms --------------------------------------------------------------------------------
def tp_comm_s(sh: RunShape, cl: ClusterConfig) -> float:
    """Two all-reduces of b·s·h forward and two backward per layer and micro-batch (with SP an all-gather
    and a reduce-scatter each, the same bytes); full recomputation repeats the forward's two. An MoE
    layer's routed experts need none (each rank routes its own tokens): only its attention's and its
    shared expert's. Planned as Megatron's --tp-comm-overlap (--model-tp-comm-overlap): each layer's
    communication hides behind its linear GEMMs and only the excess is exposed."""
    t = sh.tp
    if t == 1:
        return 0.0
    per = 2 * (t - 1) / t * sh.local_tokens * sh.h * sh.act_bytes / ring_link(sh, cl, "tp", t)
    per += (2 if sh.sp else 1) * ring_latency_s(sh, cl, "tp", t, all_reduce=not sh.sp)  # SP: a gather and a scatter
    reps = 2 + sh.recomputed_share
    shared = sh.cfg.model.moe_shared_expert_intermediate_size

    def layer_s(kind: LayerShape) -> float:
        ops = 1 if kind.moe and not shared else 2  # the attention's, and the MLP's unless all routed
        out = ops * reps * per
        return max(0.0, out - linear_s(sh, cl, kind)) if cl.model_tp_comm_overlap else out

    # the busiest stage: rank 0 under an even split
    return sum(n * layer_s(kind) for kind, n in sh.kinds_in(sh.busiest_stage).items()) * sh.m


def cp_layer_bytes(sh: RunShape, kind: str) -> list[tuple[str, int, float]]:
    """(group axis, group size, bytes on the link) of one layer and micro-batch of --cp-comm-type ``kind``.
    p2p (ring): each rank sends its K/V chunk (2·b·(s/c)·n_kv·d) c - 1 times forward and dK/dV c - 1 times
    backward; a2a: 4 all-to-alls forward and 4 backward of the local activations, (c - 1)/c of each leaving
    the rank; allgather: K/V gathered forward, dK/dV reduce-scattered backward. a2a+p2p: the sum of an a2a
    over the all-to-all group (a ranks, "cp_a2a") and a ring over the ring group (c/a ranks, "cp_ring") whose
    K/V chunk, a·s/c tokens of n_kv/a groups, has the same bytes; modelled as the sum of the two, as
    neither overlaps the other."""
    c, m = sh.cp, sh.cfg.model
    kv = 2 * sh.local_tokens * m.heads_per_tp_rank(sh.tp)[1] * m.kv_channels * sh.act_bytes
    width = sh.h  # q, k, v and the output, per token over the heads
    if m.multi_latent_attention:  # per head at the core's width (planning/mla.py)
        kv, width = sh.local_tokens * mla.cp_kv_elements(m, sh.tp) * sh.act_bytes, m.num_attention_heads * \
            mla.core_width(m)

    def a2a(n: int) -> float:
        return 8 * sh.local_tokens * width / sh.tp * sh.act_bytes * (n - 1) / n

    if kind == "a2a":
        return [("cp", c, a2a(c))]
    if kind == "a2a+p2p":
        a = sh.cp_a2a
        return [("cp_a2a", a, a2a(a)), ("cp_ring", c // a, 2 * kv * (c // a - 1))]
    return [("cp", c, 2 * kv * (c - 1))]  # p2p and allgather move the same bytes


def cp_comm_s(sh: RunShape, cl: ClusterConfig) -> float:
    """Context parallelism per micro-batch: every layer of the first pipeline rank by its own --cp-comm-type
    (``cp_layer_bytes``), each part over the link its group uses (allgather's all-gather and reduce-scatter
    as rings, p2p and a2a per rank); full recomputation repeats the forward's."""
    if sh.cp == 1:
        return 0.0
    kinds = sh.cfg.parallel.layer_cp_comm_types(sh.cfg.model.num_layers)
    layers = sh.split.rank_layers(sh.busiest_stage)
    per = sum(nbytes / (ring_link if kinds[i] == "allgather" else link)(sh, cl, axis, size) for i in layers
              for axis, size, nbytes in cp_layer_bytes(sh, kinds[i]) if size > 1)
    return per * (1 + sh.recomputed_share / 2) * sh.m


def pp_comm_s(sh: RunShape, cl: ClusterConfig) -> float:
    """An activation forward and a gradient backward per micro-batch and chunk, b·s·h (s/t with SP):
    on the critical path of the schedule."""
    if sh.pp == 1:
        return 0.0
    msg = sh.local_tokens * sh.h * sh.act_bytes / (sh.tp if sh.sp else 1)
    return 2 * sh.v * sh.m * msg / link(sh, cl, "pp", sh.pp)


def _grad_sync_s(sh: RunShape, cl: ClusterConfig, n: int, d: int, bw: float, shards_params: bool,
                 lat: float = 0.0) -> float:
    """One gradient buffer of ``n`` elements synchronised over ``d`` ranks (see dp_comm_s), each collective
    also costing ``lat`` (a ring's latency; an all-reduce twice): per bucket, ZeRO-3's per layer. Exposed:
    what is not overlapped, and what is overlapped beyond the work it runs behind (_overlap_windows_s)."""
    dd = sh.cfg.ddp
    frac = (d - 1) / d
    bucket_numel = dd.ddp_bucket_size or max(40_000_000, 1_000_000 * d)
    nb = -(-n // bucket_numel) if dd.overlap_grad_reduce else 1  # collectives per buffer: its buckets
    if shards_params:  # ZeRO-3: per micro-batch a reduce-scatter and two weight gathers (or one per step)
        gathers = 1 if dd.fsdp_keep_params_across_microbatches else 2 * sh.m
        reduce, gather = sh.m * frac * n * sh.grad_bytes, gathers * frac * n * sh.param_bytes
        units = sh.layers_in(state_stage(sh)) + 1  # a layer each, and the rest of the stage
        calls = (sh.m * units, gathers * units)
    elif dd.shards_grads:  # ZeRO-2: a reduce-scatter per micro-batch, one weight gather per step
        reduce, gather = sh.m * frac * n * sh.grad_bytes, frac * n * sh.param_bytes
        calls = (sh.m * nb, nb)
    elif dd.shards_optimizer:
        reduce, gather = frac * n * sh.grad_bytes, frac * n * sh.param_bytes
        calls = (nb, nb)
    else:
        reduce, gather = 2 * frac * n * sh.grad_bytes, 0.0
        calls = (2 * nb, 0)  # an all-reduce's latency is about twice a reduce-scatter's
    reduce, gather = reduce / bw + calls[0] * lat, gather / bw + calls[1] * lat
    bucket = min(1.0, bucket_numel / max(n, 1))
    hidden_r = reduce * (1 - bucket) if dd.overlap_grad_reduce else 0.0  # the last bucket is never hidden
    hidden_g = gather * (1 - bucket) if dd.overlap_param_gather else 0.0  # nor the first gather
    window_r, window_g = _overlap_windows_s(sh, cl, shards_params)
    if shards_params or dd.shards_grads:  # both run during the micro-batches' work, on one link
        late = max(0.0, hidden_r + hidden_g - window_r - window_g)
    else:
        late = max(0.0, hidden_r - window_r) + max(0.0, hidden_g - window_g)
    return reduce - hidden_r + gather - hidden_g + late


def _overlap_windows_s(sh: RunShape, cl: ClusterConfig, shards_params: bool) -> tuple[float, float]:
    """The work the overlapped gradient reduction and weight gathers can run behind (a rank's compute and
    memory-bound work; backward two thirds of it). Plain DP and the distributed optimizer reduce during the
    last micro-batch's backward and gather during the next step's first forward; ZeRO-2 reduces during
    every backward; ZeRO-3 also gathers during every forward and backward."""
    work = compute_s(sh, cl) + memory_bound_s(sh, cl)
    dd = sh.cfg.ddp
    if shards_params:
        return 2 * work / 3, work / 3
    if dd.shards_grads:
        return 2 * work / 3, work / (3 * sh.m)
    return 2 * work / (3 * sh.m), work / (3 * sh.m)


def dp_comm_s(sh: RunShape, cl: ClusterConfig) -> float:
    """The gradient buffer once per step over the DP x CP ranks: an all-reduce, or with the distributed
    optimizer a reduce-scatter of gradients and an all-gather of weights (ZeRO-2: the reduce-scatter per
    micro-batch; ZeRO-3: also two weight all-gathers per micro-batch, docs/parallelism.md), at the group's ring
    bandwidth (ring_bytes_per_s; hierarchical reduction moves the same bytes across nodes). Exposed: all of it, or with
    --overlap-grad-reduce the last bucket, plus the all-gather unless --overlap-param-gather. Routed
    experts have their own buffer: expert_dp_comm_s."""
    d = sh.dp * sh.cp
    if d == 1:
        return 0.0
    axis = "dp"
    inter = crosses_nodes(sh, cl, axis, sh.dp) or (sh.cp > 1 and crosses_nodes(sh, cl, "cp", sh.cp))
    n = stage_dense_params(sh, state_stage(sh))
    k = dp_cp_ranks_per_node(sh, cl) if sh.cp > 1 else ranks_per_node_in_group(sh, cl, axis, d)
    lat = ring_latency_s(sh, cl, axis, d, per_node=k)
    return _grad_sync_s(sh, cl, n, d, ring_bytes_per_s(cl, inter, k), sh.cfg.ddp.shards_params, lat)


def expert_dp_comm_s(sh: RunShape, cl: ClusterConfig) -> float:
    """The routed experts' gradient buffer over expert-DP, as the dense one over DP (their weights are
    never sharded by ZeRO-3)."""
    if sh.edp == 1 or EXPERT_FAMILY not in sh.families:
        return 0.0
    n = max(stage_expert_params(sh, r) for r in {0, sh.pp - 1})
    return _grad_sync_s(sh, cl, n, sh.edp, ring_link(sh, cl, "edp", sh.edp), False,
                        ring_latency_s(sh, cl, "edp", sh.edp))


def embedding_comm_s(sh: RunShape, cl: ClusterConfig) -> float:
    """The tied embedding's gradient, all-reduced between first and last stage once per step."""
    if sh.pp == 1 or not sh.cfg.model.tied_embeddings:
        return 0.0
    n = sh.padded_vocab // sh.tp * sh.h
    return n * sh.grad_bytes / link(sh, cl, "pp", sh.pp)  # a 2-rank ring all-reduce: 2(2 - 1)/2 = 1 buffer


def moe_step_comm_bytes(sh: RunShape, stage: int = 0) -> dict[tuple[str, str], float]:
    """Bytes one rank of pipeline rank ``stage`` hands to each token-dispatch collective per step (keyed as
    ProcessGroups.comm_bytes): per MoE layer and micro-batch the forward's (twice with full
    recomputation) and the backward's."""
    if EXPERT_FAMILY not in sh.families:
        return {}
    times = sh.m * sh.moe_layers_in(stage)
    again = 1 + sh.recomputed_share
    return {key: times * (fwd * again + bwd) for key, (fwd, bwd) in dispatch_comm_bytes(sh).items()}


def all_to_all_s(sh: RunShape, cl: ClusterConfig, axis: str, size: int, nbytes: float) -> float:
    """All-to-alls in which each rank hands ``nbytes`` (its own part included): (size - 1)/size of them
    leave it, to the group's ranks on other nodes over the network and to those on its node over NVLink,
    at once."""
    if size == 1 or nbytes == 0:
        return 0.0
    local = ranks_per_node_in_group(sh, cl, axis, size)
    intra, inter = nbytes * (local - 1) / size, nbytes * (size - local) / size
    return max(intra / cl.link_bytes_per_s(False), inter / cl.link_bytes_per_s(True) if inter else 0.0)


def ep_comm_s(sh: RunShape, cl: ClusterConfig) -> float:
    """Token dispatch over EP (alltoall: k·T rows each way per MoE layer and micro-batch, forward and
    backward; the fullest rank receives --moe-imbalance times the mean, and the all-to-all waits for it);
    with the allgather dispatcher the ring all-gathers and reduce-scatters over expert-TP x EP (every
    rank moves all the tokens whatever the routing)."""
    out = 0.0
    for (kind, _), nbytes in moe_step_comm_bytes(sh).items():
        if kind == "ep":
            out += all_to_all_s(sh, cl, "ep", sh.ep, nbytes) * cl.moe_imbalance
        elif kind == "emp":
            n = sh.ep * sh.etp
            out += (n - 1) / n * nbytes / ring_link(sh, cl, "emp", n)
    return out


def etp_comm_s(sh: RunShape, cl: ClusterConfig) -> float:
    """alltoall over expert-TP: every expert-TP rank gets the rows (etp x k·T handed each way), the
    partial sums come back."""
    nbytes = sum(v for (kind, _), v in moe_step_comm_bytes(sh).items() if kind == "etp")
    return all_to_all_s(sh, cl, "etp", sh.etp, nbytes) * cl.moe_imbalance


@dataclass
class TimeReport:
    terms: dict[str, float] = field(default_factory=dict)
    model_flops: float = 0.0  # per step, all ranks, without recomputation (MFU's count)
    hardware_flops: float = 0.0  # with full recomputation's extra forward
    world: int = 1

    @property
    def step_s(self) -> float:
        return sum(self.terms.values())

    def tflops_per_gpu(self, with_recompute: bool = False) -> float:
        f = self.hardware_flops if with_recompute else self.model_flops
        return f / self.world / self.step_s / 1e12


def step_time(sh: RunShape, cl: ClusterConfig) -> TimeReport:
    terms = {"compute": compute_s(sh, cl), "memory-bound work": memory_bound_s(sh, cl),
             "optimizer step": optimizer_s(sh, cl), "pipeline bubble": bubble_s(sh, cl), "TP comm": tp_comm_s(sh, cl),
             "CP comm": cp_comm_s(sh, cl), "PP comm": pp_comm_s(sh, cl), "DP comm": dp_comm_s(sh, cl),
             "embedding comm": embedding_comm_s(sh, cl)}
    spec = cl.spec()  # eager kernels' costs, only where the device's spec gives them (planning/eager.py)
    if spec.op_overhead_us is not None:
        terms["operator calls"] = op_overhead_s(sh, cl)
    if spec.mask_gelems_per_s is not None:
        terms["dropout masks"] = dropout_mask_s(sh, cl)
    if spec.eager_score_passes:
        terms["attention score passes"] = eager_scores_s(sh, cl)
    if EXPERT_FAMILY in sh.families:
        terms.update({"MoE dispatch (EP)": ep_comm_s(sh, cl), "MoE expert-TP comm": etp_comm_s(sh, cl),
                      "expert DP comm": expert_dp_comm_s(sh, cl)})
    return TimeReport(terms, step_flops(sh, False), step_flops(sh, True), sh.world)

