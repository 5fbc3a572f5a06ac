"""Promises of Qwen2/2.5 (biases on q/k/v only: --disable-bias-linear --add-qkv-bias) proven against
transformers' Qwen2ForCausalLM (tests/hf_family.py): from-hf gives its logits; pretrain_gpt.py --finetune logs
the losses of transformers' model + torch AdamW on the same samples (fp32, within 1e-5); TP2 + SP (the bias
split with the fused QKV's per-group rows) and PP2 give the serial curve, on plain gloo and under NCCL's
point-to-point rules; to-hf of the trained checkpoint is a Qwen2ForCausalLM with megalite's logits; greedy
generation equals transformers'. Models are built from configs; nothing is downloaded."""

from __future__ import annotations

import json
import os

import pytest

from tests import hf_family as H
from tests.plan_params import assert_planner_counts_hf


def qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


QWEN2 = H.Family("qwen2", "Qwen2ForCausalLM", qwen2_config)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> H.Prepared:
    return H.prepare(QWEN2, str(tmp_path_factory.mktemp("qwen2")))


def test_comes_in_with_qkv_bias_only(qwen2):
    flags = qwen2.model_flags
    assert "--disable-bias-linear" in flags and "--add-qkv-bias" in flags
    assert any(k.endswith("q_proj.bias") for k in qwen2.hf_model.state_dict())


def test_from_hf_gives_transformers_logits(qwen2):
    H.assert_imported_logits(qwen2)


def test_finetune_equals_transformers_and_adamw(qwen2):
    H.assert_finetune_equals_hf(qwen2)


@pytest.mark.parametrize("layout, nccl", [("tp2_sp", True), ("pp2", True)])
def test_layouts_give_the_serial_curve(qwen2, layout, nccl):
    H.assert_layout_equals_serial(qwen2, layout, nccl)


def test_to_hf_of_the_trained_checkpoint_is_qwen2_with_megalites_logits(qwen2, tmp_path):
    out = str(tmp_path / "out")
    H.assert_exported_logits(qwen2, out)
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == ["Qwen2ForCausalLM"] and "attention_bias" not in config


def test_greedy_generation_equals_transformers(qwen2):
    H.assert_generation_equals_hf(qwen2)


def test_planner_counts_transformers_parameters(qwen2):
    assert_planner_counts_hf(qwen2)
