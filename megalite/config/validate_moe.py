"""The MoE flags' rules: what they need of each other and of the layout (config/moe.py holds the flags)."""

from __future__ import annotations

from megalite.config.arguments import MegaliteConfig


def moe_errors(cfg: MegaliteConfig) -> list[str]:
    """The MoE flags' rules, and what they need of the layout (empty for a dense model)."""
    m, p = cfg.model, cfg.parallel
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    etp = p.expert_tensor_parallel_size or tp
    errors = []
    if ep <= 0 or etp <= 0:
        return [f"--expert-model-parallel-size ({ep}) and --expert-tensor-parallel-size ({etp}) must be positive"]
    if not m.is_moe:
        if ep > 1 or p.expert_tensor_parallel_size not in (None, tp):
            errors.append("--expert-model-parallel-size / --expert-tensor-parallel-size need --num-experts")
        return errors
    E, k = m.num_experts, m.moe_router_topk
    for flag, size in (("--moe-ffn-hidden-size", m.moe_ffn_hidden_size),
                       ("--moe-shared-expert-intermediate-size", m.moe_shared_expert_intermediate_size)):
        if size is not None and size <= 0:  # given, so not "missing"; 0 would silently mean the default
            errors.append(f"{flag} must be positive, got {size}")
    if not 0 < k <= E:
        errors.append(f"--moe-router-topk ({k}) must be between 1 and --num-experts ({E})")
    if E % ep:
        errors.append(f"--expert-model-parallel-size ({ep}) must divide --num-experts ({E})")
    if m.expert_ffn_hidden_size > 0 and m.expert_ffn_hidden_size % etp:
        errors.append(f"--expert-tensor-parallel-size ({etp}) must divide the expert hidden size "
                      f"(--moe-ffn-hidden-size {m.expert_ffn_hidden_size})")
    try:
        if not any(m.moe_layers()):
            errors.append(f"--moe-layer-freq '{m.moe_layer_freq}' makes none of the {m.num_layers} layers "
                          f"(--num-layers) an MoE layer, yet --num-experts is {E}: mark at least one layer 1, "
                          "or drop --num-experts for a dense model")
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
    if m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
        errors.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    if m.moe_pad_expert_input_to_capacity and m.moe_token_dispatcher_type != "alltoall":
        errors.append("--moe-pad-expert-input-to-capacity needs --moe-token-dispatcher-type alltoall (the allgather "
                      "dispatcher does not pad)")
    errors += _unsupported_with_moe(cfg, ep, etp, tp)
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        errors.append("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (as in "
                      "Megatron-LM and DeepSeek-V3)")
    errors += _group_routing_errors(m.num_experts, k, m.moe_router_num_groups, m.moe_router_group_topk)
    if m.moe_router_pre_softmax and m.moe_router_score_function != "softmax":
        errors.append("--moe-router-pre-softmax needs --moe-router-score-function softmax")
    if m.moe_shared_expert_gate and m.moe_shared_expert_intermediate_size is None:
        errors.append("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")
    if m.moe_shared_expert_intermediate_size and m.moe_shared_expert_intermediate_size % tp:
        errors.append(f"--tensor-model-parallel-size ({tp}) must divide --moe-shared-expert-intermediate-size "
                      f"({m.moe_shared_expert_intermediate_size})")
    return errors


def _group_routing_errors(E: int, k: int, groups: int | None, group_topk: int | None) -> list[str]:
    """Group-limited routing: equal groups, no more chosen than exist, and k experts scored and found in them."""
    if groups is None and group_topk is None:
        return []
    if group_topk is None:
        return [f"--moe-router-num-groups ({groups}) needs --moe-router-group-topk (the groups each token's "
                "experts come from); without it the groups have no effect"]
    if groups is None:
        return [f"--moe-router-group-topk ({group_topk}) needs --moe-router-num-groups"]
    if E % groups:
        return [f"--moe-router-num-groups ({groups}) must divide --num-experts ({E})"]
    if group_topk > groups:
        return [f"--moe-router-group-topk ({group_topk}) must be at most --moe-router-num-groups ({groups})"]
    if k < group_topk:
        return [f"--moe-router-topk ({k}) must be at least --moe-router-group-topk ({group_topk}): a group is scored "
                "by the sum of its top topk // group-topk expert scores"]
    if k > group_topk * (E // groups):
        return [f"--moe-router-topk ({k}) must fit in the chosen groups: at most --moe-router-group-topk "
                f"({group_topk}) x experts per group ({E // groups})"]
    return []


def _unsupported_with_moe(cfg: MegaliteConfig, ep: int, etp: int, tp: int) -> list[str]:
    """Features whose machinery does not know routed experts yet."""
    errors = []
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
