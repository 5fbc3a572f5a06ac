"""Promises of the Llama families proven against transformers' LlamaForCausalLM (tests/hf_family.py):
from-hf gives transformers' logits; pretrain_gpt.py --finetune logs the losses of transformers' model + torch
AdamW on the same samples (fp32, within 1e-5); TP2 + SP and PP2 give the serial curve (plain gloo and NCCL's
point-to-point rules); to-hf of the trained checkpoint gives megalite's logits in transformers; generate.py's
greedy tokens equal transformers' generate. Models are built from configs; nothing is downloaded."""

from __future__ import annotations

import pytest

from tests import hf_family as H


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


LLAMA = H.Family("llama", "LlamaForCausalLM", llama_config)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> H.Prepared:
    return H.prepare(LLAMA, str(tmp_path_factory.mktemp("llama")))


def test_from_hf_gives_transformers_logits(llama):
    H.assert_imported_logits(llama)


def test_finetune_equals_transformers_and_adamw(llama):
    H.assert_finetune_equals_hf(llama)


@pytest.mark.parametrize("layout, nccl", [("tp2_sp", False), ("pp2", True)])
def test_layouts_give_the_serial_curve(llama, layout, nccl):
    H.assert_layout_equals_serial(llama, layout, nccl)


def test_to_hf_of_the_trained_checkpoint_gives_megalites_logits(llama, tmp_path):
    H.assert_exported_logits(llama, str(tmp_path / "out"))


def test_greedy_generation_equals_transformers(llama):
    H.assert_generation_equals_hf(llama)
