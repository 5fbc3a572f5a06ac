"""Qwen3-MoE (per-head q/k norms, MoE layers without a shared expert, the dense layers named by
``mlp_only_layers``) proven against transformers' Qwen3MoeForCausalLM through tests/hf_family.py, with
``norm_topk_prob`` true (megalite's default router: top-k then softmax over the k) and false
(--moe-router-pre-softmax). TP2 + SP, PP2 and EP2 equal serial. Nothing is downloaded."""

from __future__ import annotations

import pytest

from tests import hf_family as H
from tests.plan_params import assert_planner_counts_hf


def qwen3_moe_config(norm_topk_prob: bool = True):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=4, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob, mlp_only_layers=[0],
                          router_aux_loss_coef=0.0, max_position_embeddings=64,
                          rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


QWEN3_MOE = H.Family("qwen3_moe", "Qwen3MoeForCausalLM", qwen3_moe_config)
QWEN3_MOE_RAW = H.Family("qwen3_moe_raw", "Qwen3MoeForCausalLM", lambda: qwen3_moe_config(False))


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> H.Prepared:
    return H.prepare(QWEN3_MOE, str(tmp_path_factory.mktemp("qwen3_moe")))


def test_from_hf_reads_the_dense_layers_and_the_router(qwen3_moe, tmp_path):
    flags = " ".join(qwen3_moe.model_flags)
    assert "--moe-layer-freq [0,1]" in flags and "--qk-layernorm" in flags, flags
    assert "--moe-router-pre-softmax" not in flags and "--moe-shared-expert" not in flags, flags
    H.assert_imported_logits(qwen3_moe)
    raw = H.prepare(QWEN3_MOE_RAW, str(tmp_path))  # norm_topk_prob false: the k weights kept as they are
    assert "--moe-router-pre-softmax" in raw.model_flags
    H.assert_imported_logits(raw)


def test_finetune_equals_transformers_and_adamw(qwen3_moe):
    H.assert_finetune_equals_hf(qwen3_moe)


@pytest.mark.parametrize("layout, nccl", [("tp2_sp", True), ("pp2", True), ("ep2", True)])
def test_layouts_give_the_serial_curve(qwen3_moe, layout, nccl):
    H.assert_layout_equals_serial(qwen3_moe, layout, nccl)


def test_to_hf_of_the_trained_checkpoint_gives_megalites_logits(qwen3_moe, tmp_path):
    H.assert_exported_logits(qwen3_moe, str(tmp_path / "out"))


def test_greedy_generation_equals_transformers(qwen3_moe):
    H.assert_generation_equals_hf(qwen3_moe)


def test_planner_counts_transformers_parameters(qwen3_moe):
    assert_planner_counts_hf(qwen3_moe)
