"""DeepSeek-V3 (DeepseekV3ForCausalLM) proven against transformers through tests/hf_family.py: multi-latent
attention with query compression, YaRN (factor, original context, beta fast/slow, mscale = mscale_all_dim as the
published config), the first layer dense and three MoE layers, 4 routed experts in 2 groups with the top 1 group
kept, 1 shared expert, sigmoid scores with a perturbed e_score_correction_bias (megalite's expert bias), a
routed scaling factor. Every weight perturbed. The finetune runs with --moe-router-bias-update-rate 0, as
transformers moves no bias and has no load-balancing loss. Layouts under NCCL's point-to-point rules: TP2 + SP,
PP2, EP2 with DP2 and the distributed optimizer in one 4-rank launch, CP2 p2p, CP2 a2a. Nothing is
downloaded."""

from __future__ import annotations

import json
import os
import re

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


def mtp_depth(p: H.Prepared, seed: int = 9) -> dict[str, torch.Tensor]:
    """One multi-token prediction depth as DeepSeek-V3's checkpoints store it (layer index num_hidden_layers):
    a perturbed decoder layer of transformers' own class with its experts one by one, the depth's norms and
    projection, and copies of the embedding and head."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    cfg, n = p.hf_model.config, p.hf_model.config.num_hidden_layers
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 0.1  # noqa: E731
    out = {}
    for name, t in DeepseekV3DecoderLayer(cfg, layer_idx=n).state_dict().items():
        t = rand(*t.shape) + (1.0 if name.endswith("layernorm.weight") else 0.0)  # (its experts start empty)
        if name == "mlp.experts.gate_up_proj":
            for j, e in enumerate(t):
                out[f"mlp.experts.{j}.gate_proj.weight"], out[f"mlp.experts.{j}.up_proj.weight"] = e.chunk(2)
        elif name == "mlp.experts.down_proj":
            out.update((f"mlp.experts.{j}.down_proj.weight", e) for j, e in enumerate(t))
        else:
            out[name] = t
    h = cfg.hidden_size
    out.update({"enorm.weight": 1 + rand(h), "hnorm.weight": 1 + rand(h), "eh_proj.weight": rand(h, 2 * h),
                "shared_head.norm.weight": 1 + rand(h), "embed_tokens.weight": p.hf_model.model.embed_tokens.weight,
                "shared_head.head.weight": p.hf_model.lm_head.weight})
    return {f"model.layers.{n}.{k}": v.detach().contiguous() for k, v in out.items()}


def with_tensors(p: H.Prepared, folder, extra: dict[str, torch.Tensor]) -> str:
    """A copy of the saved folder whose one weight file also holds ``extra``."""
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    for name in os.listdir(p.hf_folder):
        (folder / name).write_bytes(open(os.path.join(p.hf_folder, name), "rb").read())
    sd = load_file(str(folder / "model.safetensors"))
    save_file({**sd, **extra}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def megalite_mtp_losses(checkpoint: str, tokens: torch.Tensor) -> torch.Tensor:
    """The first MTP depth's per-token loss [b, s] of a megalite checkpoint (one rank, labels = next tokens)."""
    from megalite.checkpointing import load_checkpoint
    from megalite.checkpointing.metadata import model_config
    from megalite.checkpointing.reader import CheckpointReader
    from megalite.config.arguments import MegaliteConfig
    from megalite.model.build import build_model
    from megalite.parallel.groups import ProcessGroups
    from megalite.tensor_parallel.random import model_parallel_seed

    saved = CheckpointReader(checkpoint).config
    mcfg, vocab = model_config(saved)
    flat = {**{k: v for k, v in saved.items() if k in vars(mcfg)}, "vocab_size": vocab, "mock_data": True}
    pg = ProcessGroups.single()
    chunks = build_model(MegaliteConfig.from_flat(flat), pg, vocab, model_parallel_seed(1, 0, 0))
    load_checkpoint(checkpoint, chunks, None, pg, saved, load_optim=False, load_rng=False)
    chunks[0](tokens, torch.roll(tokens, -1, 1))
    return chunks[0].mtp_per_token[0].detach()


@torch.no_grad()
def reference_mtp_losses(p: H.Prepared, depth: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """The same loss as DeepSeek-V3's MTP module computes it (vLLM's DeepSeek MTP reads these checkpoints so):
    eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]) through transformers' own decoder layer, shared_head.norm and
    the head, against t_{i+2}."""
    import torch.nn.functional as F
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    hf, c = p.hf_model, p.hf_model.config
    d = {k.split(".", 3)[3]: v for k, v in depth.items()}  # without model.layers.{n}.
    layer, E = DeepseekV3DecoderLayer(c, layer_idx=c.num_hidden_layers).eval(), c.n_routed_experts
    layer.load_state_dict({k: torch.stack([torch.cat([d[f"mlp.experts.{j}.gate_proj.weight"],
                                                      d[f"mlp.experts.{j}.up_proj.weight"]]) for j in range(E)])
                           if k.endswith("gate_up_proj") else
                           torch.stack([d[f"mlp.experts.{j}.down_proj.weight"] for j in range(E)])
                           if k.endswith("experts.down_proj") else d[k] for k in layer.state_dict()})

    def norm(name: str, x: torch.Tensor) -> torch.Tensor:
        module = DeepseekV3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        module.weight.copy_(d[name])
        return module(x)

    h = hf.model(input_ids=tokens).last_hidden_state
    e = hf.model.embed_tokens(torch.roll(tokens, -1, 1))
    x = F.linear(torch.cat([norm("enorm.weight", e), norm("hnorm.weight", h)], -1), d["eh_proj.weight"])
    pos = torch.arange(tokens.shape[1])[None]
    out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=hf.model.rotary_emb(x, pos))
    logits = hf.lm_head(norm("shared_head.norm.weight", out[0] if isinstance(out, tuple) else out))
    labels = torch.roll(tokens, -2, 1)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)


def test_multi_token_prediction_depth_imports_and_exports(dsv3, tmp_path):
    """A checkpoint's MTP depth becomes --mtp-num-layers 1: the main model's logits unchanged, the depth's loss
    that of DeepSeek-V3's MTP module built from transformers' decoder layer (the last two positions aside, where
    the shifted tokens run out); to-hf writes every one of its tensors back as stored, in a file transformers
    loads around."""
    from safetensors import safe_open

    depth = mtp_depth(dsv3)
    folder = with_tensors(dsv3, tmp_path / "mtp", depth)
    imported = str(tmp_path / "imported")
    flags = H.from_hf(folder, imported)
    assert "--mtp-num-layers 1" in " ".join(flags), flags
    tokens = H.sample_tokens(DSV3)
    with torch.no_grad():
        want = dsv3.hf_model(input_ids=tokens).logits
    H.assert_close_logits(H.megalite_logits(imported, tokens), want, "from-hf with an MTP depth")
    ours, ref = megalite_mtp_losses(imported, tokens)[:, :-2], reference_mtp_losses(dsv3, depth, tokens)[:, :-2]
    assert (ours - ref).abs().max() <= H.TOL, (ours - ref).abs().max()
    out = str(tmp_path / "out")
    assert H.convert(["to-hf", "--load", imported, "--save", out]) == 0
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"]
    for name, t in depth.items():
        with safe_open(os.path.join(out, index[name]), "pt") as f:
            assert torch.equal(f.get_tensor(name), t), name
    H.assert_close_logits(H.hf_logits(out, DSV3.hf_class, tokens), want, "to-hf with an MTP depth")


@pytest.mark.parametrize("change, message", [
    (lambda d: {**d, "model.layers.4.bogus.weight": torch.zeros(2)}, "tensor model.layers.4.bogus.weight of a "
     "multi-token prediction depth"),
    (lambda d: {**d, "model.layers.4.embed_tokens.weight": d["model.layers.4.embed_tokens.weight"] + 1},
     "model.layers.4.embed_tokens.weight differs from model.embed_tokens.weight"),
    (lambda d: {**d, "model.layers.6.enorm.weight": torch.ones(32)}, "layers \\[4, 6\\] past num_hidden_layers 4"),
])
def test_multi_token_prediction_mismatches_are_refused_by_name(dsv3, tmp_path, capsys, change, message):
    folder = with_tensors(dsv3, tmp_path / "mtp", change(mtp_depth(dsv3)))
    out = tmp_path / "out"
    assert H.convert(["from-hf", "--load", folder, "--save", str(out)]) != 0
    err = capsys.readouterr().err
    assert re.search(message, err) and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
