"""Promise (megalite/planning/model_shape.py): the planner reads the model's own description of itself. Each
layer's kind is the one the model builds (an MoE or a dense MLP, from the same config method), the families
a layer's parameters fall in are the runtime's ParamFamily names, and the planner's per-layer parameter
counts are the built layers' (for a dense model, an MoE model, and one mixing both by --moe-layer-freq).
No term of the planner asks which kind of model it is."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from megalite.config.model import ModelConfig
from megalite.planning.model_shape import DENSE_FAMILY, EXPERT_FAMILY, FAMILY_ORDER, ModelShape
from tests.test_planning import planner_cfg

ROOT = Path(__file__).resolve().parents[1]
MODEL = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, max_position_embeddings=16)
MOE = dict(num_experts=4, moe_router_topk=2, disable_bias_linear=True, moe_shared_expert_intermediate_size=16,
           moe_shared_expert_gate=True)
CASES = {"dense": {}, "moe": MOE, "mixed": dict(MOE, moe_layer_freq="([0]*1+[1]*2+[0]*1)"),
         "every-2nd": dict(MOE, moe_layer_freq="2", swiglu=True),
         # q/k norms (per head, LayerNorm: weight and bias; over the projection, GQA) and the layer's norms
         "qk-head-pre-post": dict(qk_layernorm=True, sublayer_norms="pre-post"),
         "qk-projection-post": dict(qk_layernorm=True, qk_layernorm_scope="projection", normalization="RMSNorm",
                                    sublayer_norms="post", group_query_attention=True, num_query_groups=2)}


def _built_layers(fields: dict) -> list[tuple[bool, set[str], dict[str, int]]]:
    """Per built layer: whether its MLP is an MoE layer, its parameters' family names, its element counts
    by family (one process, meta tensors)."""
    from megalite.model.gpt import GPTModel
    from megalite.moe.layer import MoELayer
    from megalite.parallel.groups import ProcessGroups
    from megalite.tensor_parallel.context import BuildContext
    from megalite.tensor_parallel.param_meta import param_meta
    from megalite.tensor_parallel.random import RNGTracker

    ctx = BuildContext(ProcessGroups.single(), RNGTracker(), device=torch.device("meta"))
    model = GPTModel(ModelConfig(**MODEL, **fields), ctx, 64)
    out = []
    for _, layer in sorted(model.layers.items(), key=lambda kv: int(kv[0])):
        counts: dict[str, int] = {}
        for p in layer.parameters():
            name = param_meta(p).family.name
            counts[name] = counts.get(name, 0) + p.numel()
        out.append((isinstance(layer.mlp, MoELayer), set(counts), counts))
    return out


def test_family_names_are_the_runtimes():
    from megalite.tensor_parallel.param_meta import DENSE, EXPERT, FAMILIES, model_families

    assert (DENSE_FAMILY, EXPERT_FAMILY) == (DENSE.name, EXPERT.name) and FAMILY_ORDER == tuple(FAMILIES)
    for fields in CASES.values():
        cfg = ModelConfig(**MODEL, **fields)
        assert ModelShape.of(cfg).families == tuple(f.name for f in model_families(bool(cfg.num_experts)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_kinds_and_counts_are_the_built_models(case):
    """Each layer's kind and families as the model builds it, and the planner's dense-buffer and expert
    parameters of each layer (TP = EP = 1) equal to the built layer's by family."""
    from megalite.planning.memory import expert_params, frozen_params, layer_params
    from megalite.planning.shape import RunShape

    fields = CASES[case]
    sh = RunShape.of(planner_cfg({**MODEL, **fields}, 1, micro_batch_size=1, global_batch_size=1), 1, 64)
    shape = ModelShape.of(ModelConfig(**MODEL, **fields))
    assert shape == sh.model_shape
    for kind, (built_moe, families, counts) in zip(shape.layers, _built_layers(fields), strict=True):
        assert kind.moe == built_moe and set(kind.families) == families
        assert counts[DENSE_FAMILY] == layer_params(sh, kind)
        if kind.moe:
            assert counts[EXPERT_FAMILY] == expert_params(sh) + frozen_params(sh)


def test_no_model_kind_branch_in_the_planner():
    """planning/ reads the per-layer description: no ``is_moe`` (config's or its own) anywhere in it."""
    offences = []
    for path in sorted((ROOT / "megalite" / "planning").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else \
                node.name if isinstance(node, ast.FunctionDef) else None
            if name == "is_moe":
                offences.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offences, offences
