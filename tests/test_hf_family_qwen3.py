"""Qwen3 (per-head q/k norms: --qk-layernorm) proven against transformers' Qwen3ForCausalLM through
tests/hf_family.py: from-hf logits, the finetune equal to transformers + torch AdamW (fp32, 1e-5), TP2 + SP
and PP2 equal to serial (plain gloo and NCCL's point-to-point rules), to-hf logits, greedy generation.
Models are built from configs; nothing is downloaded."""

from __future__ import annotations

import pytest

from tests import hf_family as H
from tests.plan_params import assert_planner_counts_hf


def qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                       rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


QWEN3 = H.Family("qwen3", "Qwen3ForCausalLM", qwen3_config)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> H.Prepared:
    return H.prepare(QWEN3, str(tmp_path_factory.mktemp("qwen3")))


def test_from_hf_reads_the_qk_norms(qwen3):
    assert "--qk-layernorm" in qwen3.model_flags and "--qk-layernorm-scope" not in qwen3.model_flags
    H.assert_imported_logits(qwen3)


def test_finetune_equals_transformers_and_adamw(qwen3):
    H.assert_finetune_equals_hf(qwen3)


@pytest.mark.parametrize("layout, nccl", [("tp2_sp", True), ("pp2", True)])
def test_layouts_give_the_serial_curve(qwen3, layout, nccl):
    H.assert_layout_equals_serial(qwen3, layout, nccl)


def test_to_hf_of_the_trained_checkpoint_gives_megalites_logits(qwen3, tmp_path):
    H.assert_exported_logits(qwen3, str(tmp_path / "out"))


def test_greedy_generation_equals_transformers(qwen3):
    H.assert_generation_equals_hf(qwen3)


def test_planner_counts_transformers_parameters(qwen3):
    assert_planner_counts_hf(qwen3)


def test_export_picks_the_family_by_its_norms_and_refuses_a_mix():
    """Per-head q/k norms export as Qwen3, projection ones with post norms as OLMo 2; projection q/k norms with
    pre norms match no family (no Llama silently dropping them): refused with what each family lacks."""
    from megalite.checkpointing.hf.common import HFConversionError
    from megalite.checkpointing.hf.registry import for_export
    from megalite.config.model import ModelConfig

    llama = dict(num_layers=2, hidden_size=32, num_attention_heads=4, position_embedding_type="rope",
                 normalization="RMSNorm", swiglu=True, disable_bias_linear=True)
    assert for_export(ModelConfig(**llama, qk_layernorm=True)).architecture == "Qwen3ForCausalLM"
    assert for_export(ModelConfig(**llama, qk_layernorm=True, qk_layernorm_scope="projection",
                                  sublayer_norms="post")).architecture == "Olmo2ForCausalLM"
    with pytest.raises(HFConversionError) as e:
        for_export(ModelConfig(**llama, qk_layernorm=True, qk_layernorm_scope="projection"))
    assert "Olmo2ForCausalLM needs" in str(e.value) and "missing: --sublayer-norms post" in str(e.value)
    assert "LlamaForCausalLM needs" in str(e.value) and "missing: no --qk-layernorm" in str(e.value)
