"""Mixture-of-experts terms of the plan: parameters, activations, dispatch buffers and the bytes token
dispatch moves (megalite/moe, docs/planning.md "Mixture of experts").

A stage's ranks (TP x CP x DP) are cut again as expert-TP x EP x expert-DP: each rank holds E/ep routed
experts, each expert's hidden size split over expert-TP; the router, the shared expert (split over TP like
the dense MLP) and the gate are dense parameters. Each rank routes its own T tokens (split over TP with
sequence parallelism, over CP); the k assignments of each go to the rank holding the expert (EP) and to
every expert-TP rank of it, and the expert-TP ranks' partial sums come back the same way.
"""

from __future__ import annotations

import math

from megalite.planning.model_shape import EXPERT_FAMILY
from megalite.planning.shape import RunShape

INDEX_BYTES = 8  # int64 token / expert indices


# ---- parameters ------------------------------------------------------------------------------------
def moe_dense_params(sh: RunShape) -> int:
    """An MoE layer's parameters reduced over DP like the dense ones: the router [E, h] (replicated), the
    shared expert (split over TP) and its gate [1, h]. MoE layers have no linear biases."""
    m, h = sh.cfg.model, sh.h
    n = m.num_experts * h
    shared = m.moe_shared_expert_intermediate_size
    if shared:
        n += ((2 * shared if m.gated_linear_unit else shared) // sh.tp) * h + h * (shared // sh.tp)
        n += h if m.moe_shared_expert_gate else 0
    return n


def expert_params(sh: RunShape) -> int:
    """The routed experts one rank holds in one MoE layer: E/ep experts of fc1 [2F or F, h] and fc2 [h, F],
    F split over expert-TP."""
    m, h = sh.cfg.model, sh.h
    f = m.expert_ffn_hidden_size
    rows = 2 * f if m.gated_linear_unit else f
    return m.num_experts // sh.ep * (rows // sh.etp * h + h * (f // sh.etp))


def frozen_params(sh: RunShape) -> int:
    """Per MoE layer, the fp32 expert bias [E] (--moe-router-enable-expert-bias): stored with the model,
    moved by the step, no gradient and no optimizer state."""
    m = sh.cfg.model
    return m.num_experts if m.moe_router_enable_expert_bias else 0


def active_mlp_params(sh: RunShape) -> int:
    """Parameters one token goes through in an MoE layer's MLP (unsplit): router, k experts, shared
    expert and gate."""
    m, h = sh.cfg.model, sh.h
    f, s = m.expert_ffn_hidden_size, m.moe_shared_expert_intermediate_size or 0
    per = 3 if m.gated_linear_unit else 2
    return m.num_experts * h + m.moe_router_topk * per * h * f + per * h * s + (h if s and m.moe_shared_expert_gate
                                                                                 else 0)


# ---- tokens and rows -------------------------------------------------------------------------------
def routed_tokens(sh: RunShape) -> int:
    """T: the tokens one rank routes per micro-batch (the sequence split over CP, and over TP with SP)."""
    return sh.local_tokens // (sh.tp if sh.sp else 1)


def sent_rows(sh: RunShape) -> float:
    """Rows one rank dispatches per micro-batch: its k·T assignments (dropless), at most E x capacity
    with a capacity factor, exactly E x capacity when padded to it."""
    m, T, k = sh.cfg.model, routed_tokens(sh), sh.cfg.model.moe_router_topk
    if m.moe_expert_capacity_factor is None:
        return float(k * T)
    full = m.num_experts * math.ceil(T * k / m.num_experts * m.moe_expert_capacity_factor)
    return float(full if m.moe_pad_expert_input_to_capacity else min(k * T, full))


def expert_rows(sh: RunShape) -> float:
    """Rows one rank's experts compute per micro-batch, with balanced routing: its EP group's assignments
    to its experts (as many as it sends), from every expert-TP rank of the group."""
    return sh.etp * sent_rows(sh)


# ---- activations -----------------------------------------------------------------------------------
def router_activation_bytes(sh: RunShape) -> float:
    """Per MoE layer and micro-batch: the router's saved tensors. Scores are fp32: in 16-bit runs the
    input and the weight are cast (new fp32 copies); top-k keeps its indices, the softmax over the k its
    output; the load-balancing loss the softmax over all E and the token counts; the z-loss the logits
    and their log-sum-exp.
    In 16-bit runs nothing but the shared expert keeps the pre-MLP norm's output, which the layer's own
    terms count (the router keeps its fp32 copy): taken off here."""
    m, T, E, k = sh.cfg.model, routed_tokens(sh), sh.cfg.model.num_experts, sh.cfg.model.moe_router_topk
    n = 4 * (T * sh.h + E * sh.h) if sh.act_bytes != 4 else 0.0
    if sh.act_bytes != 4 and not m.moe_shared_expert_intermediate_size:
        n -= T * sh.h * sh.act_bytes
    n += INDEX_BYTES * T * k + 4 * T * k
    if m.moe_aux_loss_coeff > 0 and m.moe_router_load_balancing_type != "none":
        n += 4 * T * E + 4 * E
    if m.moe_z_loss_coeff:
        n += 4 * T * E + 4 * T
    return n


def dispatch_activation_bytes(sh: RunShape) -> float:
    """Per MoE layer and micro-batch: what dispatch and combine keep. The experts' input rows (their
    GEMMs' input), the index of each row's token and of its probability, the probabilities, the fp32
    copy of the expert outputs the weighted sum multiplies and the weighted rows the sum adds (index_add
    keeps its source); alltoall also keeps the permutation to and from expert order, over the received
    rows. With --model-te-layers (Megatron-Core's fused permutation): the experts' input rows and their
    row map, and per combined row the expert output and its probability (the unpermute's backward)."""
    e, sent, rows = sh.act_bytes, sent_rows(sh), expert_rows(sh)
    if sh.te_layers:  # Megatron-Core's fused permute / unpermute: the rows, their map, the output rows and probs
        return rows * sh.h * e + INDEX_BYTES * rows + sent * (sh.h * e + 4)
    if sh.cfg.model.moe_token_dispatcher_type == "alltoall":
        indices = INDEX_BYTES * (2 * sent + 2 * rows)
        combined = sent
    else:  # allgather: every step works on the rows this rank's experts compute
        indices = INDEX_BYTES * 2 * rows
        combined = rows
    return rows * sh.h * e + indices + combined * (8 * sh.h + 4)


def expert_activation_bytes(sh: RunShape) -> float:
    """Per MoE layer and micro-batch: the experts' fc1 output and activation on their rows, the hidden
    size split over expert-TP (SwiGLU: fc1 output 2F, SiLU output and product F each; GeLU 2F)."""
    m = sh.cfg.model
    f = m.expert_ffn_hidden_size // sh.etp
    swiglu = 3 * f if sh.te_layers else 4 * f  # Transformer Engine's fused SwiGLU keeps fc1's output and its own
    return expert_rows(sh) * (swiglu if m.gated_linear_unit else 2 * f) * sh.act_bytes


def shared_expert_activation_bytes(sh: RunShape) -> float:
    """Per MoE layer and micro-batch: the shared expert as a dense MLP of its hidden size (split over TP),
    and with the gate the expert's output and the sigmoid the product keeps."""
    m = sh.cfg.model
    s = m.moe_shared_expert_intermediate_size
    if not s:
        return 0.0
    n = sh.local_tokens * (4 * s if m.gated_linear_unit else 2 * s) / sh.tp * sh.act_bytes
    if m.moe_shared_expert_gate:
        n += routed_tokens(sh) * (sh.h + 1) * sh.act_bytes
    return n


def moe_mlp_activation_bytes(sh: RunShape) -> float:
    """An MoE layer's MLP part, in place of the dense MLP's fc1 output and activation."""
    return (router_activation_bytes(sh) + dispatch_activation_bytes(sh) + expert_activation_bytes(sh)
            + shared_expert_activation_bytes(sh))


def dispatch_buffer_bytes(sh: RunShape) -> float:
    """Transient, one MoE layer at a time: alltoall's sent and received rows; allgather's gathered tokens
    and the fp32 weighted sum it reduce-scatters."""
    if EXPERT_FAMILY not in sh.families:
        return 0.0
    if sh.cfg.model.moe_token_dispatcher_type == "alltoall":
        return (sent_rows(sh) + expert_rows(sh)) * sh.h * sh.act_bytes
    return sh.etp * sh.ep * routed_tokens(sh) * sh.h * (sh.act_bytes + 4)


# ---- communication: bytes counted per MoE layer and micro-batch ------------------------------------
def dispatch_comm_bytes(sh: RunShape) -> dict[tuple[str, str], tuple[float, float]]:
    """(forward, backward) bytes one rank hands to each dispatch collective per MoE layer and micro-batch,
    keyed as ProcessGroups.comm_bytes counts them (the input of an all-to-all and a reduce-scatter, the
    output of an all-gather, a rank's own part included). Row counts are the balanced averages (a rank's
    received rows vary with routing; over a group they sum to the sent ones). alltoall, each way, forward
    and backward: k·T rows over EP, etp x k·T over expert-TP, plus forward the token counts (E int64);
    allgather: the group's T tokens (and their k fp32 probabilities) gathered and the outputs
    reduce-scattered over expert-TP x EP, the duals in backward, the routing gathered forward."""
    m, h, e = sh.cfg.model, sh.h, sh.act_bytes
    T, k, E = routed_tokens(sh), m.moe_router_topk, m.num_experts
    out: dict[tuple[str, str], tuple[float, float]] = {}
    if m.moe_token_dispatcher_type == "alltoall":
        rows = sent_rows(sh)
        if sh.ep > 1:
            out[("ep", "moe_counts")] = (E * INDEX_BYTES, 0.0)
            out[("ep", "moe_all_to_all")] = (2 * rows * h * e, 2 * rows * h * e)
        if sh.etp > 1:
            out[("etp", "moe_routing_all_gather")] = (sh.etp * E * INDEX_BYTES, 0.0)
            out[("etp", "moe_all_to_all")] = (2 * sh.etp * rows * h * e, 2 * sh.etp * rows * h * e)
        return out
    n = sh.etp * sh.ep
    if n > 1:
        out[("emp", "moe_all_gather")] = (n * T * (h * e + 4 * k), n * T * (h * e + 4 * k))
        out[("emp", "moe_routing_all_gather")] = (n * T * k * (INDEX_BYTES + 1), 0.0)
        out[("emp", "moe_reduce_scatter")] = (n * T * h * e, n * T * h * e)
    return out
