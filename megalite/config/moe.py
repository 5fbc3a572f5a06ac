"""Mixture-of-experts flags (Megatron-LM names), part of the model section (their rules: validate_moe.py)."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from megalite.config.domain import MAX_HIDDEN, MAX_SIZE, Domain, positive, size
from megalite.config.flags import option

MAX_LAYERS = 100_000  # a depth or repeat count past any model's is a typo, refused before the list is built


@dataclass(kw_only=True)
class MoEFields:
    """Mixture of experts: an MoE layer (router, routed experts, optional shared expert) in place of the MLP."""

    num_experts: int | None = option(None, help="Routed experts per MoE layer (None: a dense model).",
                                      domain=size(MAX_HIDDEN))
    moe_ffn_hidden_size: int | None = option(None, help="Hidden size of each routed expert; default (unset) "
                                              "--ffn-hidden-size.", domain=size())
    moe_router_topk: int = option(2, help="Experts each token is routed to (k).", domain=size(MAX_HIDDEN))
    moe_layer_freq: str = option(
        "1", help="Which layers are MoE: an integer N (every N-th layer, starting with layer 0) or a Python list of "
        "0/1 per layer such as '([0]*1+[1]*3)' (1 = MoE); at least one layer must be MoE.")
    moe_shared_expert_intermediate_size: int | None = option(
        None, help="Hidden size of the shared expert every token also goes through (None: no shared expert).",
        domain=size())
    moe_shared_expert_gate: bool = option(
        False, help="Scale the shared expert's output by sigmoid(x . w) per token (Qwen2-MoE's shared_expert_gate).")
    moe_router_score_function: str = option(
        "softmax", help="Router scores: softmax over the experts, or a per-expert sigmoid.",
        choices=["softmax", "sigmoid"])
    moe_router_pre_softmax: bool = option(
        False, help="Softmax over all experts before top-k (the top-k probabilities are not renormalised; "
        "Qwen2-MoE). Default: top-k over the logits, then softmax over the k (Mixtral).")
    moe_router_num_groups: int | None = option(
        None, help="Group-limited routing: the experts form this many equal groups of consecutive ids (with "
        "--moe-router-group-topk; DeepSeek-V3's n_group).", domain=size(MAX_HIDDEN))
    moe_router_group_topk: int | None = option(
        None, help="Group-limited routing: each token's top-k experts are chosen among the experts of its this "
        "many best groups, a group scored by the sum of its top --moe-router-topk / this expert scores "
        "(DeepSeek-V3's topk_group; None: plain top-k).", domain=size(MAX_HIDDEN))
    moe_router_topk_scaling_factor: float | None = option(
        None, help="Multiply the top-k probabilities by this factor.", domain=positive())
    moe_router_load_balancing_type: str = option(
        "aux_loss", help="Load balancing: the switch-transformer auxiliary loss over the micro-batch (aux_loss), "
        "over each sequence (seq_aux_loss), or none.", choices=["aux_loss", "seq_aux_loss", "none"])
    moe_aux_loss_coeff: float = option(0.0, help="Coefficient of the load-balancing loss.",
                                       domain=Domain(lo=0, lo_open=True, off=0, off_means="is not computed"))
    moe_z_loss_coeff: float | None = option(
        None, help="Coefficient of the router z-loss, mean over tokens of logsumexp(logits)^2 (None: off).",
        domain=Domain(lo=0, lo_open=True, off=0, off_means="is off, as None"))
    moe_router_enable_expert_bias: bool = option(
        False, help="Aux-loss-free load balancing: a per-expert bias added to the scores for the top-k choice only, "
        "moved once per step by --moe-router-bias-update-rate toward the mean token count (global counts).")
    moe_router_bias_update_rate: float = option(
        1e-3, help="Step of the expert-bias update (0: the bias stays as loaded, e.g. fine-tuning an imported "
        "DeepSeek-V3 as transformers does).", domain=Domain(lo=0))
    moe_expert_capacity_factor: float | None = option(
        None, help="Each expert takes at most capacity = ceil(tokens x topk / experts x factor) of a rank's "
        "tokens; the rest are dropped (None: dropless).", domain=positive(hi=MAX_SIZE))
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


def moe_layer_pattern(freq: str, num_layers: int, flag: str = "--moe-layer-freq") -> list[bool]:
    """--moe-layer-freq as one flag per layer: 'N' is every N-th layer from layer 0; a list literal
    (arithmetic on lists allowed, as Megatron evaluates it) gives 0/1 per layer."""
    text = str(freq).strip()
    if text.lstrip("-").isdigit():
        every = int(text)
        if every <= 0:
            raise ValueError(f"{flag} must be a positive integer or a list, got {text}")
        return [i % every == 0 for i in range(num_layers)]
    try:
        values = _list_expression(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError) as e:
        raise ValueError(f"{flag} '{text}' is neither an integer nor a list of 0/1 such as "
                         f"'([0]*1+[1]*3)' ({e})") from None
    if len(values) != num_layers or any(v not in (0, 1) for v in values):
        raise ValueError(f"{flag} '{text}' must give 0 or 1 for each of the {num_layers} layers "
                         f"(--num-layers), got {values}")
    return [bool(v) for v in values]


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
