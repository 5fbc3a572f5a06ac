"""OLMo 2 (norms on each sublayer's output: --sublayer-norms post; q/k norms over the whole projection:
--qk-layernorm --qk-layernorm-scope projection) proven against transformers' Olmo2ForCausalLM through
tests/hf_family.py. One KV group, so at TP2 both ranks hold a copy of the K rows and of the k norm's weight
and the all-reduced sum of squares counts the group on each. Nothing is downloaded."""

from __future__ import annotations

import pytest

from tests import hf_family as H
from tests.plan_params import assert_planner_counts_hf


def olmo2_config():
    from transformers import Olmo2Config

    return Olmo2Config(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                       rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


OLMO2 = H.Family("olmo2", "Olmo2ForCausalLM", olmo2_config)


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory) -> H.Prepared:
    return H.prepare(OLMO2, str(tmp_path_factory.mktemp("olmo2")))


def test_from_hf_reads_the_reordered_and_projection_norms(olmo2):
    flags = " ".join(olmo2.model_flags)
    assert "--qk-layernorm --qk-layernorm-scope projection --sublayer-norms post" in flags, flags
    H.assert_imported_logits(olmo2)


def test_finetune_equals_transformers_and_adamw(olmo2):
    H.assert_finetune_equals_hf(olmo2)


@pytest.mark.parametrize("layout, nccl", [("tp2_sp", False), ("tp2_sp", True), ("pp2", True)])
def test_layouts_give_the_serial_curve(olmo2, layout, nccl):
    H.assert_layout_equals_serial(olmo2, layout, nccl)


def test_to_hf_of_the_trained_checkpoint_gives_megalites_logits(olmo2, tmp_path):
    H.assert_exported_logits(olmo2, str(tmp_path / "out"))


def test_greedy_generation_equals_transformers(olmo2):
    H.assert_generation_equals_hf(olmo2)


def test_planner_counts_transformers_parameters(olmo2):
    assert_planner_counts_hf(olmo2)
