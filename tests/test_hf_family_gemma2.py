"""Gemma 2 (Gemma2ForCausalLM) proven against transformers through tests/hf_family.py: four zero-centred
norms per layer, GeGLU with tanh GELU, embeddings scaled by sqrt(h), the query scale of
query_pre_attn_scalar, alternating local and global layers (--window-attn-skip-freq 2), attention-logit and
final-logit soft-capping (caps small enough to bite on a tiny model's scores and logits), an untied output
layer. The sequence (48) is longer than the window (12). The TP2 + SP case also runs the fused
cross-entropy (the capped logits' gradient in chunks, vocabulary split) and full recomputation against the
serial, unfused curve. Nothing is downloaded."""

from __future__ import annotations

import pytest

from tests import hf_family as H
from tests.plan_params import assert_planner_counts_hf

WINDOW = 12
ATTN_CAP, FINAL_CAP = 2.0, 3.0


def gemma2_config():
    from transformers import Gemma2Config

    return Gemma2Config(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, query_pre_attn_scalar=12,
        layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, attn_logit_softcapping=ATTN_CAP,
        final_logit_softcapping=FINAL_CAP, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None, pad_token_id=None)


GEMMA2 = H.Family("gemma2", "Gemma2ForCausalLM", gemma2_config, seq_length=48)
FLAGS = ("--geglu", "--apply-layernorm-1p", "--sublayer-norms pre-post", f"--window-size {WINDOW - 1} 0",
         "--window-attn-skip-freq 2", f"--attn-logit-softcapping {ATTN_CAP}",
         "--embedding-multiplier 5.656854249492381", f"--softmax-scale {12 ** -0.5!r}",
         f"--final-logit-softcapping {FINAL_CAP}", "--untie-embeddings-and-output-weights")
H.LAYOUTS.setdefault("tp2_sp_fused_ce_recompute", (2, (
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--cross-entropy-loss-fusion",
    "--recompute-granularity", "full")))


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory) -> H.Prepared:
    return H.prepare(GEMMA2, str(tmp_path_factory.mktemp("gemma2")))


def test_from_hf_reads_gemma2s_block_and_gives_transformers_logits(gemma2):
    flags = " ".join(gemma2.model_flags)
    for flag in FLAGS:
        assert flag in flags, (flag, flags)
    assert "--swiglu" not in flags and "--qk-layernorm" not in flags, flags
    H.assert_imported_logits(gemma2)


def test_finetune_equals_transformers_and_adamw(gemma2):
    H.assert_finetune_equals_hf(gemma2)


@pytest.mark.parametrize("layout", ["tp2_sp_fused_ce_recompute", "pp2", "cp2_p2p", "cp2_a2a", "cp2_allgather"])
def test_layouts_give_the_serial_curve(gemma2, layout):
    H.assert_layout_equals_serial(gemma2, layout, nccl_semantics=True)


def test_to_hf_of_the_trained_checkpoint_gives_megalites_logits(gemma2, tmp_path):
    H.assert_exported_logits(gemma2, str(tmp_path / "out"))


def test_greedy_generation_past_the_window_equals_transformers(gemma2):
    H.assert_generation_equals_hf(gemma2, prompt_len=8, new_tokens=40)


def test_planner_counts_transformers_parameters(gemma2):
    assert_planner_counts_hf(gemma2)

