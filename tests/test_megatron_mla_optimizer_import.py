"""Promise (docs/checkpoints.md, "Megatron-LM checkpoints"): the distributed optimizer's ``dp_reshardable``
torch_dist state (Megatron-LM's default) of a model with multi-latent attention or multi-token prediction
imports with ``from-megatron``, as a dense GPT's does (tests/test_megatron_optimizer_import.py).

The reference is megatron-core on the CPU over gloo (tests/mcore_cpu.py) at TP2 x DP2: its GPTModel (local
spec, MLA's core attention as tests/test_megatron_mla.py gives it) wrapped in its DistributedDataParallel with
the distributed optimizer from ``get_megatron_optimizer``, STEPS steps of its own loss (the MTP losses added by
its MTP block), then ``dist_checkpointing.save`` of the model and the optimizer's ``dp_reshardable`` state.
Each rank keeps the distributed optimizer's own slices (its moments and fp32 main parameters), joined here over
DP and TP. Three models: MLA with query compression and its latent norms (its buffer cut into several
buckets); a Llama-style GPT with two MTP depths; MLA without query compression with one MTP depth.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megalite.checkpointing.full_reader import FullCheckpoint
from megalite.checkpointing.megatron.names import to_megalite
from tests.harness import run_ranks
from tests.test_megatron_import import TOKENS, megatron_args
from tests.test_megatron_optimizer_import import _assembled, _joined, _own_state, _wrapped
from tools.convert_checkpoint import main as convert

pytest.importorskip("megatron.core")

STEPS = 2
MLA = dict(ffn_hidden_size=48, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
           add_bias_linear=False, untie_embeddings_and_output_weights=True, qk_layernorm=True,
           multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
           v_head_dim=6, rope_type="yarn", rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=4,
           mscale=0.5, mscale_all_dim=1.0, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
           pipeline_model_parallel_size=1)
CASES = {
    "mla": megatron_args(**MLA),
    "mtp": megatron_args(ffn_hidden_size=48, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                         add_bias_linear=False, untie_embeddings_and_output_weights=True, mtp_num_layers=2,
                         mtp_loss_scaling_factor=0.3, pipeline_model_parallel_size=1),
    "mla_mtp": megatron_args(**{**MLA, "q_lora_rank": None, "mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.5}),
}
BUCKETS = {"mla": 1500}  # several buckets (overlapped gradient reduction), their edges inside MLA's layers


def _mla_config(args):
    """megatron-core's MLATransformerConfig of ``args`` at TP2 (YaRN's arguments under its config names)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
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


def _build(args):
    """megatron-core's GPTModel of ``args`` at TP2 (local spec; its MTP block when ``mtp_num_layers``), every
    parameter perturbed: replicated ones alike on both TP ranks, shards per rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    from tests.mcore_cpu import _config, _global_seed
    from tests.test_megatron_mla import _CoreAttention

    mla = getattr(args, "multi_latent_attention", False)
    cfg = _mla_config(args) if mla else _config(args, 2, 1)
    depths = getattr(args, "mtp_num_layers", None)
    if depths:
        cfg = dataclasses.replace(cfg, mtp_num_layers=depths, mtp_loss_scaling_factor=args.mtp_loss_scaling_factor)
    spec = get_gpt_layer_local_spec(multi_latent_attention=mla, qk_layernorm=getattr(args, "qk_layernorm", False),
                                    normalization=args.normalization)
    if mla:
        spec.submodules.self_attention.submodules.core_attention = _CoreAttention
    torch.manual_seed(1)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings, parallel_output=False,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False) if depths else None)
    tp_rank = ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            sharded = getattr(p, "tensor_model_parallel", False)
            g = torch.Generator().manual_seed(_global_seed(name, 0, False) + (tp_rank + 1 if sharded else 0))
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.train()


def _train_and_save(rank: int, world: int, root: str) -> dict:
    """Each case trained by megatron-core at TP2 x DP2 (the same tokens on both DP ranks) with its distributed
    optimizer and saved as ``dp_reshardable``; per case this rank's TP rank, its own slices of the optimizer's
    state and the parameter names in megatron-core's registration order."""
    from tests.mcore_cpu import cpu_shim, optimizer_cpu_shim, save_megatron

    cpu_shim()
    optimizer_cpu_shim()
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False  # its fp8 check asks isinstance of Transformer Engine's absent class
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    out = {}
    b, s = TOKENS.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    labels = TOKENS.roll(-1, dims=1)
    for name, args in CASES.items():
        model = _build(args)
        options = {"overlap_grad_reduce": True, "bucket_size": BUCKETS[name]} if name in BUCKETS else {}
        ddp, opt = _wrapped(model, True, **options)
        for _ in range(STEPS):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            ddp(TOKENS, torch.arange(s).expand(b, s), mask, labels=labels, loss_mask=torch.ones(b, s)).mean().backward()
            ddp.finish_grad_sync()
            assert opt.step()[0]
        state = opt.sharded_state_dict(model.sharded_state_dict(),
                                       metadata={"distrib_optim_sharding_type": "dp_reshardable"})
        save_megatron(model, args, os.path.join(root, name), STEPS, optimizer=state)
        out[name] = {"tp": ps.get_tensor_model_parallel_rank(), "state": _own_state(model, opt),
                     "order": [n for n, _ in model.named_parameters()]}
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("mla_optim"))
    return root, run_ranks(_train_and_save, 4, root, timeout=240)  # TP rank = rank % 2, DP rank = rank // 2


@pytest.mark.parametrize("name", list(CASES))
def test_dp_reshardable_state_of_mla_and_mtp_imports(saved, name, tmp_path, capsys):
    """``from-megatron`` carries megatron-core's own distributed-optimizer state over: every parameter's Adam
    moments and fp32 main parameter (each DP rank's slice joined, then TP's shards), exactly, and the step."""
    root, ranks = saved
    own = [_assembled([r[name]["state"] for r in ranks if r[name]["tp"] == t]) for t in range(2)]
    assert all(len(r[name]["state"]) < len(own[0]) for r in ranks)  # each DP rank holds only part of it
    out = str(tmp_path / "imported")
    assert convert(["from-megatron", "--load", os.path.join(root, name), "--save", out,
                    "--tensor-model-parallel-size", "2"]) == 0
    said = capsys.readouterr().out
    assert f"Adam state of step {STEPS} imported (dp_reshardable)" in said, said
    ckpt = FullCheckpoint(out)
    assert ckpt.has_optimizer() and ckpt.optimizer_step() == STEPS
    names = list(own[0])
    assert any(".linear_kv_down_proj." in n for n in names) == ("mla" in name)
    assert any(n.startswith("mtp.layers.") for n in names) == ("mtp" in name)
    for field in ("exp_avg", "exp_avg_sq", "main"):
        want = to_megalite(names, lambda n, f=field: _joined(own, n, f, True), "reference")
        assert sorted(want) == sorted(ckpt.keys())
        for key, t in want.items():
            assert torch.count_nonzero(t) > 0, key  # real gradients: the test compares something
            torch.testing.assert_close(ckpt.optim(key, field), t, rtol=0, atol=0, msg=f"{key} {field}")
