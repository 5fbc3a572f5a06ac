"""Promises of the Mistral family (one sliding window for all layers, --window-size) proven against
transformers' MistralForCausalLM (tests/hf_family.py): the sequence (48) is longer than the window (12,
--window-size 11 0), so every layer's window cuts; from-hf gives transformers' logits; pretrain_gpt.py
--finetune logs the losses of transformers' model + torch AdamW on the same samples (fp32, within 1e-5);
TP2 + SP, PP2 and CP2 (p2p, a2a, allgather) give the serial curve, plain gloo and under NCCL's point-to-point
rules; to-hf of the trained checkpoint gives megalite's logits in transformers; generate.py's greedy tokens
(KV cache holding the window) equal transformers' generate for 40 tokens, all past the window."""

from __future__ import annotations

import pytest

from tests import hf_family as H

WINDOW = 12


def mistral_config():
    from transformers import MistralConfig

    return MistralConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, rms_norm_eps=1e-5,
                         sliding_window=WINDOW, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)


MISTRAL = H.Family("mistral", "MistralForCausalLM", mistral_config, seq_length=48)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> H.Prepared:
    return H.prepare(MISTRAL, str(tmp_path_factory.mktemp("mistral")))


def test_window_comes_in_as_window_size(mistral):
    flags = " ".join(mistral.model_flags)
    assert f"--window-size {WINDOW - 1} 0" in flags, flags


def test_from_hf_gives_transformers_logits(mistral):
    H.assert_imported_logits(mistral)


def test_finetune_equals_transformers_and_adamw(mistral):
    H.assert_finetune_equals_hf(mistral)


# each layout under NCCL's point-to-point rules (gloo plus the checks; plain gloo adds nothing the
# rules do not already run)
@pytest.mark.parametrize("layout, nccl", [("tp2_sp", True), ("pp2", True), ("cp2_p2p", True), ("cp2_a2a", True),
                                          ("cp2_allgather", True)])
def test_layouts_give_the_serial_curve(mistral, layout, nccl):
    H.assert_layout_equals_serial(mistral, layout, nccl)


def test_to_hf_of_the_trained_checkpoint_gives_megalites_logits(mistral, tmp_path):
    H.assert_exported_logits(mistral, str(tmp_path / "out"))


def test_greedy_generation_equals_transformers(mistral):
    H.assert_generation_equals_hf(mistral, prompt_len=8, new_tokens=40)
