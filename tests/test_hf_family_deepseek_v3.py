"""DeepSeek-V3 (DeepseekV3ForCausalLM) proven against transformers through tests/hf_family.py: multi-latent
attention with query compression, YaRN (factor, original context, beta fast/slow, mscale = mscale_all_dim as the
published config), the first layer dense and three MoE layers, 4 routed experts in 2 groups with the top 1 group
kept, 1 shared expert, sigmoid scores with a perturbed e_score_correction_bias (megalite's expert bias), a
routed scaling factor. Every weight perturbed. The finetune runs with --moe-router-bias-update-rate 0, as
transformers moves no bias and has no load-balancing loss. Layouts under NCCL's point-to-point rules: TP2 + SP,
PP2, EP2 with DP2 and the distributed optimizer in one 4-rank launch, CP2 p2p, CP2 a2a. Nothing is
downloaded."""

from __future__ import annotations

import os

import pytest
import torch

from tests import hf_family as H
from tests.plan_params import assert_planner_counts_hf

YARN = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 16.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def deepseek_v3_config(**over):
    from transformers import DeepseekV3Config

    fields = dict(vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                  q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                  n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                  norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=64,
                  rope_parameters=dict(YARN), rope_interleave=True, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return DeepseekV3Config(**{**fields, **over})


DSV3 = H.Family("deepseek_v3", "DeepseekV3ForCausalLM", deepseek_v3_config,
                extra_flags=("--moe-router-bias-update-rate", "0"))
# two ranks: data-parallel 2 with the experts split over them (EP2), the optimizer state sharded over DP
H.LAYOUTS.setdefault("ep2_dp2_distopt", (2, ("--expert-model-parallel-size", "2", "--use-distributed-optimizer")))


def prepare(root: str) -> H.Prepared:
    """hf_family.prepare, with the router's e_score_correction_bias (a buffer, not a parameter) perturbed too."""
    model = H.build_hf(DSV3)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn(b.shape, generator=gen) * 0.1)
    folder = os.path.join(root, "hf_deepseek_v3")
    model.save_pretrained(folder)
    imported = os.path.join(root, "imported_deepseek_v3")
    return H.Prepared(DSV3, root, folder, imported, H.from_hf(folder, imported), model)


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory) -> H.Prepared:
    return prepare(str(tmp_path_factory.mktemp("deepseek_v3")))


def test_from_hf_reads_mla_yarn_and_the_router(dsv3):
    flags = " ".join(dsv3.model_flags)
    for flag in ("--multi-latent-attention", "--q-lora-rank 24", "--kv-lora-rank 16", "--qk-head-dim 8",
                 "--qk-pos-emb-head-dim 4", "--v-head-dim 6", "--position-embedding-type yarn",
                 "--rotary-scaling-factor 4.0", "--yarn-original-max-position-embeddings 16", "--mscale-all-dim 1.0",
                 "--moe-layer-freq [0,1,1,1]", "--num-experts 4", "--moe-shared-expert-intermediate-size 16",
                 "--moe-router-score-function sigmoid", "--moe-router-enable-expert-bias",
                 "--moe-router-num-groups 2", "--moe-router-group-topk 1", "--moe-router-topk-scaling-factor 2.5",
                 "--moe-router-load-balancing-type none", "--norm-epsilon 1e-06"):
        assert flag in flags, (flag, flags)
    biases = [b for n, b in dsv3.hf_model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert len(biases) == 3 and all(b.abs().sum() > 0 for b in biases)
    H.assert_imported_logits(dsv3)


PLAIN = H.Family("deepseek_v3_plain", "DeepseekV3ForCausalLM", lambda: deepseek_v3_config(
    num_hidden_layers=2, first_k_dense_replace=0, q_lora_rank=None, rope_parameters={"rope_type": "default",
    "rope_theta": 5000.0}, n_group=1, topk_group=1, num_experts_per_tok=1, norm_topk_prob=False,
    routed_scaling_factor=1.0, tie_word_embeddings=True))


def test_without_query_compression_yarn_or_groups_both_ways(tmp_path):
    """q_proj instead of the query latent, plain RoPE, every layer MoE, top-1 unnormalised, no groups, no
    scaling, tied embeddings: from-hf gives transformers' logits, and to-hf of the import gives them back."""
    plain = H.prepare(PLAIN, str(tmp_path))
    flags = " ".join(plain.model_flags)
    assert "--moe-layer-freq 1" in flags and "--position-embedding-type rope" in flags, flags
    for absent in ("--q-lora-rank", "--moe-router-num-groups", "--moe-router-topk-scaling-factor",
                   "--untie-embeddings-and-output-weights"):
        assert absent not in flags, (absent, flags)
    H.assert_imported_logits(plain)
    out = str(tmp_path / "out")
    assert H.convert(["to-hf", "--load", plain.imported, "--save", out]) == 0
    tokens = H.sample_tokens(PLAIN, seed=11)
    with torch.no_grad():
        want = plain.hf_model(input_ids=tokens).logits
    H.assert_close_logits(H.hf_logits(out, PLAIN.hf_class, tokens), want, "to-hf of the plain import")


def test_finetune_equals_transformers_and_adamw(dsv3):
    H.assert_finetune_equals_hf(dsv3)


@pytest.mark.parametrize("layout", ["tp2_sp", "pp2", "ep2_dp2_distopt", "cp2_p2p", "cp2_a2a"])
def test_layouts_give_the_serial_curve(dsv3, layout):
    H.assert_layout_equals_serial(dsv3, layout, nccl_semantics=True)


def test_to_hf_of_the_trained_checkpoint_gives_megalites_logits(dsv3, tmp_path):
    H.assert_exported_logits(dsv3, str(tmp_path / "out"))


def test_greedy_generation_with_the_latent_cache_equals_transformers(dsv3):
    H.assert_generation_equals_hf(dsv3)


def test_planner_counts_transformers_parameters(dsv3):
    """The planner counts the expert bias as a (never optimized) parameter, as megalite stores it; transformers
    holds it as a buffer, which num_parameters() leaves out."""
    biases = sum(b.numel() for n, b in dsv3.hf_model.named_buffers() if n.endswith("e_score_correction_bias"))

    class WithBuffers:
        def num_parameters(self) -> int:
            return dsv3.hf_model.num_parameters() + biases

    assert biases == 3 * 4
    assert_planner_counts_hf(H.Prepared(dsv3.family, dsv3.root, dsv3.hf_folder, dsv3.imported, dsv3.model_flags,
                                        WithBuffers()))


@pytest.mark.parametrize("over, message", [
    ({"attention_bias": True}, "attention_bias True"),
    ({"rope_interleave": False}, "rope_interleave false"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps 1e-05"),
    ({"norm_topk_prob": False}, "norm_topk_prob False"),
    ({"n_group": 2, "topk_group": 1, "num_experts_per_tok": 1, "norm_topk_prob": False},
     "n_group 2, topk_group 1, num_experts_per_tok 1"),
    ({"first_k_dense_replace": 4}, "first_k_dense_replace 4 leaves no MoE layer"),
])
def test_unconvertible_configs_are_refused_by_name(over, message):
    from megalite.checkpointing.hf.common import HFConversionError
    from megalite.checkpointing.hf.convert import from_hf_config

    with pytest.raises(HFConversionError, match=message.replace("(", r"\(")):
        from_hf_config(deepseek_v3_config(**over))


def test_multi_token_prediction_layers_are_refused_by_name(dsv3, tmp_path, capsys):
    """An HF checkpoint's MTP module (layer index num_hidden_layers) is named, not dropped."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "mtp"
    folder.mkdir()
    for name in os.listdir(dsv3.hf_folder):
        (folder / name).write_bytes(open(os.path.join(dsv3.hf_folder, name), "rb").read())
    sd = load_file(str(folder / "model.safetensors"))
    sd["model.layers.4.eh_proj.weight"] = torch.zeros(32, 64)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    assert H.convert(["from-hf", "--load", str(folder), "--save", str(out)]) != 0
    err = capsys.readouterr().err
    assert "layer(s) [4] past num_hidden_layers 4" in err and "multi-token prediction" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists()
