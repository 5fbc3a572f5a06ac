"""What the Hugging Face mixture-of-experts families share (their adapters are in families/): the router
requirements of a softmax top-k router, the load-balancing coefficient both ways, HF's sparse-layer rule,
the MoE layer's tensors, and the TP rule for writing experts.

transformers 5.x holds the routed experts stacked exactly as megalite does: ``mlp.experts.gate_up_proj``
[E, 2F, h] ([gate; up]) is ``mlp.experts.fc1_weight`` and ``mlp.experts.down_proj`` [E, h, F] is
``mlp.experts.fc2_weight``; ``mlp.gate.weight`` [E, h] is the router. Files that store experts one by one
(transformers 4.x's save_pretrained) are stacked by files.py on the patterns the adapters give
(``PER_EXPERT_MLP`` here, the common one).

The load-balancing loss: HF adds ``router_aux_loss_coef`` times one loss over all MoE layers' tokens
together, which is k (top-k) for a balanced router; megalite sums one loss per MoE layer, each
``--moe-aux-loss-coeff`` when balanced. ``--moe-aux-loss-coeff = router_aux_loss_coef * k / L`` (L MoE
layers) gives the same loss and the same router gradients when the layers are loaded alike.
"""

from __future__ import annotations

import re

from megalite.checkpointing.hf.common import HFConversionError, TensorRule, cat_rows, halves
from megalite.checkpointing.hf.files import ExpertFiles
from megalite.config.model import ModelConfig

# mlp.experts.{j}.gate_proj / up_proj / down_proj, one file entry per expert
PER_EXPERT_MLP = ExpertFiles(
    re.compile(r"^(model\.layers\.\d+\.)mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"),
    {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"})


def softmax_router_requirements(cfg: ModelConfig) -> dict[str, bool]:
    """A router HF computes as softmax over the logits, top-k (then renormalised or not)."""
    return {"--moe-router-score-function softmax": cfg.moe_router_score_function == "softmax",
            "no --moe-router-enable-expert-bias": not cfg.moe_router_enable_expert_bias,
            "no --moe-router-topk-scaling-factor": cfg.moe_router_topk_scaling_factor in (None, 1.0),
            "no --moe-router-group-topk": not cfg.moe_router_group_topk}


def _coeff(x: float) -> float:
    return float(f"{x:.12g}")  # so a coefficient survives the scaling both ways unchanged


def aux_coeff_from_hf(router_aux_loss_coef: float, topk: int, moe_layers: int) -> float:
    """--moe-aux-loss-coeff of HF's router_aux_loss_coef (module doc)."""
    return _coeff(router_aux_loss_coef * topk / max(moe_layers, 1))


def aux_coeff_to_hf(cfg: ModelConfig) -> float:
    """HF's router_aux_loss_coef of megalite's --moe-aux-loss-coeff (module doc)."""
    if cfg.moe_router_load_balancing_type == "none":
        return 0.0
    return _coeff(cfg.moe_aux_loss_coeff * sum(cfg.moe_layers()) / cfg.moe_router_topk)


def sparse_layers(step, dense_layers, num_layers: int, where: str) -> list[bool]:
    """Which layers are sparse by HF's rule: not in ``mlp_only_layers``, and (i + 1) % decoder_sparse_step == 0."""
    dense = set(dense_layers or [])
    if not isinstance(step, int) or step <= 0:
        raise HFConversionError(f"{where}: decoder_sparse_step must be a positive integer, got {step!r}")
    return [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]


def layer_freq(layers: list[bool]) -> str:
    """--moe-layer-freq of a per-layer MoE pattern: 1, else a 0/1 list."""
    return "1" if all(layers) else "[" + ",".join(str(int(x)) for x in layers) + "]"


def expert_rules(cfg: ModelConfig, m: str, h: str, shared: str | None, shared_gate: str | None
                 ) -> list[TensorRule]:
    """The tensors of one MoE layer's MLP (``m``: megalite's ``layers.{i}.``, ``h``: HF's layer prefix);
    ``shared``: the HF module of the shared expert, ``shared_gate``: its gate's weight (module doc)."""
    rules = [TensorRule(m + "mlp.router.weight", (h + "mlp.gate.weight",)),
             TensorRule(m + "mlp.experts.fc1_weight", (h + "mlp.experts.gate_up_proj",)),
             TensorRule(m + "mlp.experts.fc2_weight", (h + "mlp.experts.down_proj",))]
    if cfg.moe_shared_expert_intermediate_size:
        if shared is None:
            raise HFConversionError("this architecture has no shared expert (--moe-shared-expert-intermediate-size)")
        s = f"{h}mlp.{shared}."
        rules += [TensorRule(m + "mlp.shared_expert.fc1.weight", (s + "gate_proj.weight", s + "up_proj.weight"),
                             halves, cat_rows),
                  TensorRule(m + "mlp.shared_expert.fc2.weight", (s + "down_proj.weight",))]
        if cfg.moe_shared_expert_gate:
            if shared_gate is None:
                raise HFConversionError("this architecture has no shared-expert gate (--moe-shared-expert-gate)")
            rules.append(TensorRule(m + "mlp.shared_expert_gate", (f"{h}mlp.{shared_gate}",)))
    return rules


def moe_tp_errors(cfg: ModelConfig, tp: int) -> list[str]:
    """What writing an MoE model's checkpoint at TP size ``tp`` needs: its experts are cut over expert-TP,
    which is TP in the checkpoint's files, and so is the shared expert."""
    if not cfg.is_moe or tp <= 0:
        return []
    errors = []
    if cfg.expert_ffn_hidden_size % tp:
        errors.append(f"--tensor-model-parallel-size ({tp}) must divide the expert hidden size "
                      f"(--moe-ffn-hidden-size {cfg.expert_ffn_hidden_size})")
    shared = cfg.moe_shared_expert_intermediate_size
    if shared and shared % tp:
        errors.append(f"--tensor-model-parallel-size ({tp}) must divide --moe-shared-expert-intermediate-size "
                      f"({shared})")
    return errors
