"""Promise: multi-latent attention crosses to and from megatron-core. A megalite MLA checkpoint (query
compression, --qk-layernorm's latent norms, YaRN with both mscales, random weights, saved at TP2) is exported
with ``to-megatron`` at TP2 (torch_dist, and the legacy format cut for TP2); megatron-core's GPTModel with its
local MLA layer spec at TP2, built from the args the export saved, loads each and computes megalite's logits
(fp32, 1e-5); ``from-megatron`` of the export gives the same logits back, and so does a legacy TP2 checkpoint
of Transformer Engine's MLA spec (megatron-core's local-spec state renamed as that spec names it: fused latent and
MLP norms, down-projections whole on each TP rank, ``_extra_state`` tensors)."""

from __future__ import annotations

import os
import re

import pytest
import torch

from megalite.checkpointing.megatron.args import config_from_args
from megalite.checkpointing.megatron.safe_pickle import load_torch_file
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout
from tests.harness import run_ranks
from tests.test_megatron_export import assert_imports_back, export_random
from tests.test_megatron_import import TOKENS, _megalite_logits, megatron_args

pytest.importorskip("megatron.core")

VOCAB = 95
ARGS = megatron_args(ffn_hidden_size=48, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                     add_bias_linear=False, untie_embeddings_and_output_weights=True, qk_layernorm=True,
                     multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8,
                     qk_pos_emb_head_dim=4, v_head_dim=6, rope_type="yarn", rotary_scaling_factor=4.0,
                     yarn_original_max_position_embeddings=4, mscale=0.5, mscale_all_dim=1.0)
PG = ProcessGroups.unconnected(RankLayout(1, 1, 1), 0)


class _CoreAttention(torch.nn.Module):
    """Causal softmax(q.k scale) v over MLA's q/k and v widths: megatron-core 0.16's local
    DotProductAttention takes no separate k/v channels (its MLA runs Transformer Engine's), so the local spec
    gets this in its place; every other module is megatron-core's own."""

    def __init__(self, config, softmax_scale=None, **kwargs):  # the base Attention builds one first, unscaled
        super().__init__()
        self.scale = softmax_scale

    def forward(self, q, k, v, attention_mask, packed_seq_params=None, attn_mask_type=None):
        s, b, n, _ = q.shape  # [s, b, heads, d]
        scores = torch.einsum("sbnd,tbnd->bnst", q, k) * self.scale
        future = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        return torch.einsum("bnst,tbnd->sbnd", probs, v).reshape(s, b, -1)


def _mcore_mla(args):
    """megatron-core's GPTModel with its local MLA spec at TP2 for the export's ``args`` (YaRN's arguments
    under megatron-core's config names)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    cfg = MLATransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, qk_layernorm=args.qk_layernorm, use_cpu_initialization=True,
        params_dtype=torch.float32, tensor_model_parallel_size=2, pipeline_dtype=torch.float32,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_head_dim, qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
        rope_type=args.rope_type, rotary_base=args.rotary_base, rotary_scaling_factor=args.rotary_scaling_factor,
        original_max_position_embeddings=args.yarn_original_max_position_embeddings,
        beta_fast=args.yarn_beta_fast, beta_slow=args.yarn_beta_slow, mscale=args.mscale,
        mscale_all_dim=args.mscale_all_dim)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=args.qk_layernorm,
                                    normalization=args.normalization)
    spec.submodules.self_attention.submodules.core_attention = _CoreAttention
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, parallel_output=False,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope").eval()


# the local MLA spec's names -> Transformer Engine's MLA spec's (gpt_layer_specs.py,
# get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True, qk_layernorm=True)): the latent norms
# fused into the up-projections (TELayerNormColumnParallelLinear), the dense MLP's norm into fc1; the input norm
# stays a module of its own (TENorm)
TE_NAMES = {".self_attention.q_layernorm.": ".self_attention.linear_q_up_proj.layer_norm_",
            ".self_attention.kv_layernorm.": ".self_attention.linear_kv_up_proj.layer_norm_",
            ".pre_mlp_layernorm.": ".mlp.linear_fc1.layer_norm_"}
DOWN = re.compile(r"\.linear_(q|kv)_down_proj\.weight$")


def _te_state(model) -> dict:
    """The legacy state dict Transformer Engine's MLA spec saves for this rank of ``model`` (megatron-core's local
    spec, TP2): its names (TE_NAMES); the down-projections whole on every TP rank (TELinear, parallel_mode
    "duplicated", where the local spec's ColumnParallelLinear holds a row shard); each TE module's ``_extra_state``
    a uint8 tensor of pickled fp8 metadata (Transformer Engine 1.x and later), the core attention's included."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out = {}
    for k, v in model.state_dict().items():
        for old, new in TE_NAMES.items():
            k = k.replace(old, new)
        if DOWN.search(k):
            parts = [torch.empty_like(v) for _ in range(ps.get_tensor_model_parallel_world_size())]
            dist.all_gather(parts, v.contiguous(), group=ps.get_tensor_model_parallel_group())
            v = torch.cat(parts)
        if k.endswith("_extra_state"):
            v = torch.frombuffer(bytearray(b"fp8 metadata of " + k.encode()), dtype=torch.uint8)
        out[k] = v
        if k.endswith(".linear_proj.weight"):  # TEDotProductAttention keeps fp8 metadata too
            out[k.replace(".linear_proj.weight", ".core_attention._extra_state")] = torch.empty(0, dtype=torch.uint8)
    return out


def _save_te_legacy(model, saved: dict, folder: str, rank: int) -> None:
    """``_te_state`` saved as Megatron-LM's legacy format (its args saying --transformer-impl transformer_engine)."""
    import argparse

    path = os.path.join(folder, "iter_0000005", f"mp_rank_{rank:02d}", "model_optim_rng.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    args = argparse.Namespace(**{**vars(saved["args"]), "transformer_impl": "transformer_engine"})
    torch.save({**saved, "args": args, "model": _te_state(model)}, path)
    with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("5")


def _in_megatron(rank: int, world: int, root: str) -> dict:
    from tests.mcore_cpu import cpu_shim, logits

    cpu_shim()
    from megatron.core import dist_checkpointing
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False  # its fp8 check asks isinstance of Transformer Engine's absent class
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    out = {}
    it_dir = os.path.join(root, "mcore", "iter_0000005")
    args = load_torch_file(os.path.join(it_dir, "common.pt"))["args"]
    assert args.multi_latent_attention and args.rope_type == "yarn" and args.q_lora_rank == 24
    model = _mcore_mla(args)
    model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, it_dir)["model"])
    out["mcore"] = logits(model, TOKENS, args.hidden_size)
    saved = load_torch_file(os.path.join(root, "legacy", "iter_0000005", f"mp_rank_{rank:02d}", "model_optim_rng.pt"))
    model = _mcore_mla(saved["args"])
    model.load_state_dict(saved["model"], strict=True)
    out["legacy"] = logits(model, TOKENS, args.hidden_size)
    _save_te_legacy(model, saved, os.path.join(root, "te_legacy"), rank)
    ps.destroy_model_parallel()
    return out if rank == 0 else {}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("mla"))
    config = config_from_args(ARGS, VOCAB, "mla")
    assert config["multi_latent_attention"] and config["position_embedding_type"] == "yarn"
    export_random(root, config, tp=2, pp=1, check=("layers.1.attention.q_layernorm.weight",
                                                   "layers.1.attention.kv_layernorm.weight"))
    return root, run_ranks(_in_megatron, 2, root, timeout=120)[0]


@pytest.mark.parametrize("fmt", ["mcore", "legacy"])
def test_megatron_core_loads_the_mla_export_and_gives_megalite_logits(exported, fmt):
    root, got = exported
    want = _megalite_logits(os.path.join(root, "megalite"), PG)
    torch.testing.assert_close(got[fmt][..., :VOCAB], want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fmt", ["mcore", "legacy"])
def test_from_megatron_reads_mla_back(exported, fmt, tmp_path):
    root, _ = exported
    assert_imports_back(os.path.join(root, fmt), os.path.join(root, "megalite"), str(tmp_path / "back"))


def test_from_megatron_reads_transformer_engines_mla_legacy_checkpoint(exported, tmp_path):
    """A legacy TP2 checkpoint of Transformer Engine's MLA spec (its fused latent and MLP norms, its
    down-projections whole on each TP rank, its ``_extra_state``) imports with the local spec's logits."""
    root, _ = exported
    saved = load_torch_file(os.path.join(root, "te_legacy", "iter_0000005", "mp_rank_01", "model_optim_rng.pt"))
    keys = saved["model"]
    assert "decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight" in keys
    assert keys["decoder.layers.0.self_attention.linear_q_down_proj.weight"].shape == (ARGS.q_lora_rank, 32)
    assert not any("q_layernorm" in k or "pre_mlp_layernorm" in k for k in keys)
    assert_imports_back(os.path.join(root, "te_legacy"), os.path.join(root, "megalite"), str(tmp_path / "back"))
