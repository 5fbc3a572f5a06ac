"""Mixture-of-experts flags (Megatron-LM names), part of the model section, and their rules."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megalite.config.flags import option

if TYPE_CHECKING:
    from megalite.config.arguments import MegaliteConfig


@dataclass(kw_only=True)
class MoEFields:
    """Mixture of experts: an MoE layer (router, routed experts, optional shared expert) in place of the MLP."""

    num_experts: int | None = option(None, help="Routed experts per MoE layer (None: a dense model).")
    moe_ffn_hidden_size: int | None = option(None, help="Hidden size of each routed expert; default --ffn-hidden-size.")
    moe_router_topk: int = option(2, help="Experts each token is routed to (k).")
    moe_layer_freq: str = option(
        "1", help="Which layers are MoE: an integer N (every N-th layer, starting with layer 0) or a Python list of "
        "0/1 per layer such as '([0]*1+[1]*3)' (1 = MoE).")
    moe_shared_expert_intermediate_size: int | None = option(
        None, help="Hidden size of the shared expert every token also goes through (None: no shared expert).")
    moe_shared_expert_gate: bool = option(
        False, help="Scale the shared expert's output by sigmoid(x . w) per token (Qwen2-MoE's shared_expert_gate).")
    moe_router_score_function: str = option(
        "softmax", help="Router scores: softmax over the experts, or a per-expert sigmoid.",
        choices=["softmax", "sigmoid"])
    moe_router_pre_softmax: bool = option(
        False, help="Softmax over all experts before top-k (the top-k probabilities are not renormalised; "
        "Qwen2-MoE). Default: top-k over the logits, then softmax over the k (Mixtral).")
    moe_router_topk_scaling_factor: float | None = option(
        None, help="Multiply the top-k probabilities by this factor.")
    moe_router_load_balancing_type: str = option(
        "aux_loss", help="Load balancing: the switch-transformer auxiliary loss over the micro-batch (aux_loss), "
        "over each sequence (seq_aux_loss), or none.", choices=["aux_loss", "seq_aux_loss", "none"])
    moe_aux_loss_coeff: float = option(0.0, help="Coefficient of the load-balancing loss (0: not computed).")
    moe_z_loss_coeff: float | None = option(
        None, help="Coefficient of the router z-loss, mean over tokens of logsumexp(logits)^2 (None: off).")
    moe_router_enable_expert_bias: bool = option(
        False, help="Aux-loss-free load balancing: a per-expert bias added to the scores for the top-k choice only, "
        "moved once per step by --moe-router-bias-update-rate toward the mean token count (global counts).")
    moe_router_bias_update_rate: float = option(1e-3, help="Step of the expert-bias update.")
    moe_expert_capacity_factor: float | None = option(
        None, help="Each expert takes at most capacity = ceil(tokens x topk / experts x factor) of a rank's "
        "tokens; the rest are dropped (None: dropless).")
    moe_token_drop_policy: str = option(
        "probs", help="Over capacity, drop the tokens with the lowest routing probability (probs) or the "
        "latest in the sequence (position).", choices=["probs", "position"])
    moe_pad_expert_input_to_capacity: bool = option(
        False, help="Pad every expert's input from each rank to the capacity (fixed shapes; needs "
        "--moe-expert-capacity-factor and --moe-token-dispatcher-type alltoall).")
    moe_token_dispatcher_type: str = option(
        "allgather", help="How tokens reach experts on other ranks: alltoall (counts exchanged, then the tokens "
        "each expert needs) or allgather (every rank gathers all tokens of its expert-parallel group).",
        choices=["allgather", "alltoall"])
    moe_grouped_gemm: bool = option(
        False, help="All local experts in one grouped GEMM (torch._grouped_mm where the build has it, else a "
        "loop); default a loop over the experts.")

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size  # type: ignore[attr-defined]

    def moe_layers(self) -> list[bool]:
        """Whether each of the model's layers is an MoE layer (raises ValueError on a bad --moe-layer-freq)."""
        n = self.num_layers  # type: ignore[attr-defined]
        if not self.is_moe:
            return [False] * n
        return moe_layer_pattern(self.moe_layer_freq, n)


def moe_layer_pattern(freq: str, num_layers: int) -> list[bool]:
    """--moe-layer-freq as one flag per layer: 'N' is every N-th layer from layer 0; a list literal
    (arithmetic on lists allowed, as Megatron evaluates it) gives 0/1 per layer."""
    text = str(freq).strip()
    if text.lstrip("-").isdigit():
        every = int(text)
        if every <= 0:
            raise ValueError(f"--moe-layer-freq must be a positive integer or a list, got {text}")
        return [i % every == 0 for i in range(num_layers)]
    try:
        values = _list_expression(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError) as e:
        raise ValueError(f"--moe-layer-freq '{text}' is neither an integer nor a list of 0/1 such as "
                         f"'([0]*1+[1]*3)' ({e})") from None
    if len(values) != num_layers or any(v not in (0, 1) for v in values):
        raise ValueError(f"--moe-layer-freq '{text}' must give 0 or 1 for each of the {num_layers} layers "
                         f"(--num-layers), got {values}")
    return [bool(v) for v in values]


MAX_LAYERS = 100_000  # a repeat count past any model's depth is a typo, refused before the list is built


def _list_expression(node: ast.AST) -> list[int]:
    """Evaluate list literals, + and * of them (no names, no calls)."""
    if isinstance(node, ast.List):
        out = []
        for e in node.elts:
            if not (isinstance(e, ast.Constant) and isinstance(e.value, int)):
                raise ValueError("list elements must be integers")
            out.append(e.value)
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _list_expression(node.left) + _list_expression(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        left, right = node.left, node.right
        for seq, times in ((left, right), (right, left)):
            if isinstance(times, ast.Constant) and isinstance(times.value, int):
                if not 0 <= times.value <= MAX_LAYERS:
                    raise ValueError(f"repeat count {times.value} is not in [0, {MAX_LAYERS}]")
                return _list_expression(seq) * times.value
    raise ValueError("only list literals joined by + and repeated by * are allowed")


def moe_errors(cfg: "MegaliteConfig") -> list[str]:
    """The MoE flags' rules, and what they need of the layout (empty for a dense model)."""
    m, p = cfg.model, cfg.parallel
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    etp = p.expert_tensor_parallel_size or tp
    errors = []
    if ep <= 0 or etp <= 0:
        return [f"--expert-model-parallel-size ({ep}) and --expert-tensor-parallel-size ({etp}) must be positive"]
    if not m.is_moe:
        if m.num_experts is not None:
            errors.append(f"--num-experts must be positive, got {m.num_experts}")
        if ep > 1 or p.expert_tensor_parallel_size not in (None, tp):
            errors.append("--expert-model-parallel-size / --expert-tensor-parallel-size need --num-experts")
        return errors
    E, k = m.num_experts, m.moe_router_topk
    if not 0 < k <= E:
        errors.append(f"--moe-router-topk ({k}) must be between 1 and --num-experts ({E})")
    if E % ep:
        errors.append(f"--expert-model-parallel-size ({ep}) must divide --num-experts ({E})")
    if m.expert_ffn_hidden_size % etp:
        errors.append(f"--expert-tensor-parallel-size ({etp}) must divide the expert hidden size "
                      f"(--moe-ffn-hidden-size {m.expert_ffn_hidden_size})")
    try:
        m.moe_layers()
    except ValueError as e:
        errors.append(str(e))
    if m.add_bias_linear:
        errors.append("--num-experts needs --disable-bias-linear (routed experts have no biases, as in "
                      "Megatron's grouped experts, Mixtral and Qwen-MoE)")
    if tp > 1 and not p.sequence_parallel:
        errors.append("--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel (each rank "
                      "routes its own tokens, as in Megatron-LM)")
    if p.use_tp_pp_dp_mapping or p.rank_order != "tp-cp-dp-pp":
        errors.append("--expert-model-parallel-size needs the default --rank-order tp-cp-dp-pp")
    if m.moe_expert_capacity_factor is not None and m.moe_expert_capacity_factor <= 0:
        errors.append(f"--moe-expert-capacity-factor must be positive, got {m.moe_expert_capacity_factor}")
    if m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
        errors.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    if m.moe_pad_expert_input_to_capacity and m.moe_token_dispatcher_type != "alltoall":
        errors.append("--moe-pad-expert-input-to-capacity needs --moe-token-dispatcher-type alltoall (the allgather "
                      "dispatcher does not pad)")
    errors += _unsupported_with_moe(cfg, ep, etp, tp)
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        errors.append("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (as in "
                      "Megatron-LM and DeepSeek-V3)")
    if m.moe_router_pre_softmax and m.moe_router_score_function != "softmax":
        errors.append("--moe-router-pre-softmax needs --moe-router-score-function softmax")
    if m.moe_aux_loss_coeff < 0 or (m.moe_z_loss_coeff or 0) < 0 or m.moe_router_bias_update_rate < 0:
        errors.append("--moe-aux-loss-coeff, --moe-z-loss-coeff and --moe-router-bias-update-rate must be >= 0")
    if m.moe_shared_expert_gate and not m.moe_shared_expert_intermediate_size:
        errors.append("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")
    if m.moe_shared_expert_intermediate_size and m.moe_shared_expert_intermediate_size % tp:
        errors.append(f"--tensor-model-parallel-size ({tp}) must divide --moe-shared-expert-intermediate-size "
                      f"({m.moe_shared_expert_intermediate_size})")
    return errors


def _unsupported_with_moe(cfg: "MegaliteConfig", ep: int, etp: int, tp: int) -> list[str]:
    """Features whose machinery does not know routed experts yet."""
    errors = []
    if cfg.ddp.sharding == "optim_grads_params":  # the layer units would gather expert weights as dense ones
        errors.append("--num-experts is not supported with --data-parallel-sharding-strategy optim_grads_params "
                      "(--use-megatron-fsdp); use optim_grads or --use-distributed-optimizer")
    if cfg.parallel.hierarchical_dp_reduce and (ep > 1 or etp != tp):  # its node groups are the dense DP's
        errors.append("--hierarchical-dp-reduce is not supported with --expert-model-parallel-size > 1 or "
                      "--expert-tensor-parallel-size != --tensor-model-parallel-size (expert gradients are "
                      "reduced over expert-data-parallel groups)")
    return errors


def expert_layout_errors(world_size: int, tp: int, pp: int, cp: int, ep: int, etp: int) -> list[str]:
    """The ranks of one pipeline stage (TP x CP x DP) are cut again as expert-TP x EP x expert-DP."""
    stage = world_size // (tp * pp * cp) * tp * cp if world_size % (tp * pp * cp) == 0 else None
    if stage is None or ep * etp <= 0 or stage % (ep * etp) == 0:  # sizes <= 0: moe_errors names them
        return []
    return [f"--expert-model-parallel-size ({ep}) x --expert-tensor-parallel-size ({etp}) must divide the ranks of "
            f"a pipeline stage ({stage} = TP {tp} x CP {cp} x DP {stage // (tp * cp)})"]
