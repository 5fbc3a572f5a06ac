"""OLMo 2 (norms on each sublayer's output: --sublayer-norms post; q/k norms over the whole projection:
--qk-layernorm --qk-layernorm-scope projection) proven against transformers' Olmo2ForCausalLM through
tests/hf_family.py. One KV group, so at TP2 both ranks hold a copy of the K rows and of the k norm's weight
and the all-reduced sum of squares counts the group on each. Nothing is downloaded."""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize("layout, nccl", [("tp2_sp", True), ("pp2", True)])
def test_layouts_give_the_serial_curve(olmo2, layout, nccl):
    H.assert_layout_equals_serial(olmo2, layout, nccl)


def test_to_hf_of_the_trained_checkpoint_gives_megalites_logits(olmo2, tmp_path):
    H.assert_exported_logits(olmo2, str(tmp_path / "out"))


def test_greedy_generation_equals_transformers(olmo2):
    H.assert_generation_equals_hf(olmo2)


def test_planner_counts_transformers_parameters(olmo2):
    assert_planner_counts_hf(olmo2)


H.LAYOUTS.setdefault("tp2_sp_recompute", (2, ("--tensor-model-parallel-size", "2", "--sequence-parallel",
                                              "--recompute-granularity", "full")))


@pytest.mark.parametrize("layout", ["cp2_p2p", "tp2_sp_recompute"])
def test_context_parallel_and_recompute_give_the_serial_curve(olmo2, layout):
    H.assert_layout_equals_serial(olmo2, layout)


def test_a_tp2_checkpoint_holds_the_projection_norms_cut_and_reads_back_whole(olmo2, tmp_path):
    """from-hf written at TP2 (the q norm's weight cut in halves, the k norm's one group copied to both
    ranks), read back at TP1: transformers' logits."""
    out = str(tmp_path / "tp2")
    H.from_hf(olmo2.hf_folder, out, "--tensor-model-parallel-size", "2")
    tokens = H.sample_tokens(olmo2.family)
    with torch.no_grad():
        want = olmo2.hf_model(input_ids=tokens).logits
    H.assert_close_logits(H.megalite_logits(out, tokens), want, "olmo2 from-hf at TP2")


def test_group_rows_shard_round_trip():
    """The k norm's spec: whole groups per rank when TP <= groups, one group's copy per rank beyond."""
    from megalite.model.qk_norm import GroupRowsShardSpec

    full = torch.arange(8.0)  # 2 groups of 4 channels
    spec = GroupRowsShardSpec(dim=0, groups=2)
    for size in (1, 2, 4):
        parts = [spec.shard(full, r, size) for r in range(size)]
        assert torch.equal(spec.unshard(parts), full)
    assert torch.equal(spec.shard(full, 1, 4), full[:4]) and torch.equal(spec.shard(full, 2, 4), full[4:])
    assert spec.counted_ranges((4,), 1, 4) == [] and spec.counted_ranges((4,), 2, 4) == [(0, 4)]
