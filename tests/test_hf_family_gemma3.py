"""Gemma 3 (Gemma3ForCausalLM, model_type gemma3_text) proven against transformers through
tests/hf_family.py: four zero-centred norms per layer, GeGLU with tanh GELU, embeddings scaled by sqrt(h),
per-head q/k norms, the query scale of query_pre_attn_scalar, tied output, local and global layers (three
local to one global here: --window-attn-skip-freq 3, the last layer local again) with a RoPE base per kind
(local 10k plain, global 1M with a linear factor). The sequence (48) is longer than the window (12). The
TP2 + SP case runs full recomputation too (both RoPE tables through the recomputed layers). Nothing is
downloaded."""

from __future__ import annotations

import pytest

from tests import hf_family as H
from tests.plan_params import assert_planner_counts_hf

WINDOW = 12


def gemma3_config():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, query_pre_attn_scalar=12,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=WINDOW, rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                   "rope_theta": 1000000.0}},
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)


GEMMA3 = H.Family("gemma3", "Gemma3ForCausalLM", gemma3_config, seq_length=48)
FLAGS = ("--geglu", "--apply-layernorm-1p", "--qk-layernorm", "--sublayer-norms pre-post",
         f"--window-size {WINDOW - 1} 0", "--window-attn-skip-freq 3", "--embedding-multiplier 5.656854249492381",
         f"--softmax-scale {12 ** -0.5!r}", "--rotary-base 1000000", "--rotary-base-local 10000",
         "--rotary-seq-len-interpolation-factor 8.0")


H.LAYOUTS.setdefault("tp2_sp_recompute", (2, ("--tensor-model-parallel-size", "2", "--sequence-parallel",
                                              "--recompute-granularity", "full")))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> H.Prepared:
    return H.prepare(GEMMA3, str(tmp_path_factory.mktemp("gemma3")))


def test_from_hf_reads_gemma3s_block_and_gives_transformers_logits(gemma3):
    flags = " ".join(gemma3.model_flags)
    for flag in FLAGS:
        assert flag in flags, (flag, flags)
    assert "--swiglu" not in flags and "--untie-embeddings-and-output-weights" not in flags, flags
    H.assert_imported_logits(gemma3)


def test_finetune_equals_transformers_and_adamw(gemma3):
    H.assert_finetune_equals_hf(gemma3)


@pytest.mark.parametrize("layout", ["tp2_sp_recompute", "pp2", "cp2_p2p", "cp2_a2a", "cp2_allgather"])
def test_layouts_give_the_serial_curve(gemma3, layout):
    H.assert_layout_equals_serial(gemma3, layout, nccl_semantics=True)


def test_to_hf_of_the_trained_checkpoint_gives_megalites_logits(gemma3, tmp_path):
    H.assert_exported_logits(gemma3, str(tmp_path / "out"))


def test_greedy_generation_past_the_window_equals_transformers(gemma3):
    H.assert_generation_equals_hf(gemma3, prompt_len=8, new_tokens=40)


def test_planner_counts_transformers_parameters(gemma3):
    assert_planner_counts_hf(gemma3)
