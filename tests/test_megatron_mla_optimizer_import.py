"""Promise (docs/checkpoints.md, "Megatron-LM checkpoints"): the distributed optimizer's ``dp_reshardable``
torch_dist state (Megatron-LM's default) of a model with multi-latent attention or multi-token prediction
imports with ``from-megatron``, as a dense GPT's does (tests/test_megatron_optimizer_import.py).

The reference is megatron-core on the CPU over gloo (tests/mcore_cpu.py) on 4 ranks: its GPTModel (local
spec, MLA's core attention as tests/test_megatron_mla.py gives it) wrapped in its DistributedDataParallel with
the distributed optimizer from ``get_megatron_optimizer``, STEPS steps of its own loss (the MTP losses added by
its MTP block), then ``dist_checkpointing.save`` of the model and the optimizer's ``dp_reshardable`` state.
Each rank records the optimizer's own slices (its moments and fp32 main parameters, tests/mcore_train.py),
joined here over DP and TP. At TP2 x DP2: MLA with query compression and its latent norms (its buffer cut into
several buckets); a Llama-style GPT with two MTP depths; MLA without query compression with one MTP depth. At
TP1 (megatron-core's MoE layers train at TP > 1 only with sequence parallelism) DeepSeek-V3's kind: MLA, a
dense then an MoE layer (keyed one by one in torch_dist), a shared expert, the sigmoid router with an expert
bias, an MoE MTP depth; at EP2 x DP2 (the experts in an optimizer of their own) and at EP1 x DP4 (in the dense
buffer after each router). At PP2 (gradients set by hand, alike on both copies of the embedding): MLA with an MTP
depth at TP1 x DP2, and DeepSeek-V3's kind (4 layers, each stage a dense and an MoE one) at EP2: the last stage
holds the depths and the copy of the word embedding they need, alone in its bucket.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest
import torch

from megalite.checkpointing.full_reader import FullCheckpoint
from megalite.checkpointing.megatron.names import to_megalite
from tests.harness import run_ranks
from tests.test_megatron_import import TOKENS, megatron_args
from tools.convert_checkpoint import main as convert

pytest.importorskip("megatron.core")

STEPS = 2
MLA = dict(ffn_hidden_size=48, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
           add_bias_linear=False, untie_embeddings_and_output_weights=True, qk_layernorm=True,
           multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
           v_head_dim=6, rope_type="yarn", rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=4,
           mscale=0.5, mscale_all_dim=1.0, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
           pipeline_model_parallel_size=1, expert_model_parallel_size=1)
CASES = {
    "mla": megatron_args(**MLA),
    "mtp": megatron_args(ffn_hidden_size=48, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                         add_bias_linear=False, untie_embeddings_and_output_weights=True, mtp_num_layers=2,
                         mtp_loss_scaling_factor=0.3, pipeline_model_parallel_size=1,
                         expert_model_parallel_size=1),
    "mla_mtp": megatron_args(**{**MLA, "q_lora_rank": None, "mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.5}),
}
# DeepSeek-V3's kind at TP1 x EP2 (megatron-core's MoE layers train at TP > 1 only with sequence parallelism):
# MLA, a dense layer then an MoE one (its per-layer spec: torch_dist keys each layer apart), a shared expert, the
# sigmoid router with an expert bias, an MoE MTP depth; the experts in an optimizer of their own
DEEPSEEK = megatron_args(**{**MLA, "mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.5, "num_experts": 4,
                            "moe_ffn_hidden_size": 16, "moe_router_topk": 2, "moe_layer_freq": [0, 1],
                            "moe_shared_expert_intermediate_size": 24, "moe_router_score_function": "sigmoid",
                            "moe_router_enable_expert_bias": True, "moe_aux_loss_coeff": 0.0,
                            "moe_router_load_balancing_type": "none", "tensor_model_parallel_size": 1,
                            "expert_model_parallel_size": 2})
CASES["deepseek_ep2"] = DEEPSEEK
CASES["deepseek_ep1"] = megatron_args(**{**vars(DEEPSEEK), "expert_model_parallel_size": 1})  # experts: dense
# PP2 (on gradients set by hand): the last stage holds the MTP depths and a copy of the word embedding they
# need, megatron-core's shared embedding, alone in its bucket; TP1 x PP2 x DP2, and DeepSeek-V3's kind at PP2 x EP2
CASES["mla_mtp_pp2"] = megatron_args(**{**MLA, "mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.5,
                                        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2})
CASES["deepseek_pp2_ep2"] = megatron_args(**{**vars(DEEPSEEK), "pipeline_model_parallel_size": 2, "num_layers": 4,
                                             "moe_layer_freq": [0, 1, 0, 1]})  # experts on every stage
# the torch_dist saves: the model-space fully_reshardable one too, where the expert bias (a buffer) has no state
# either; every case is saved in the legacy format as well (distrib_optim.pt)
DEFAULT = ("dp_reshardable",)
SHARDINGS = {"deepseek_ep2": ("dp_reshardable", "fully_reshardable")}
SUFFIX = {"dp_reshardable": "", "fully_reshardable": "_fully_reshardable", "legacy": "_legacy"}
BUCKETS = {"mla": 1500}  # several buckets (overlapped gradient reduction), their edges inside MLA's layers


def _mla_config(args, tp: int, pp: int, ep: int):
    """megatron-core's MLATransformerConfig of ``args`` at TP ``tp``, PP ``pp`` and EP ``ep`` (tests/mcore_cpu.py's
    config with MLA's fields; YaRN's arguments under its config names)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from tests.mcore_cpu import _config

    base = _config(args, tp, pp, ep)
    kept = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    return MLATransformerConfig(
        **{**kept, "multi_latent_attention": True}, q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_head_dim, qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
        rope_type=args.rope_type, rotary_base=args.rotary_base, rotary_scaling_factor=args.rotary_scaling_factor,
        original_max_position_embeddings=args.yarn_original_max_position_embeddings,
        beta_fast=args.yarn_beta_fast, beta_slow=args.yarn_beta_slow, mscale=args.mscale,
        mscale_all_dim=args.mscale_all_dim)


def _build(args):
    """megatron-core's GPTModel of ``args`` at its TP and EP (local spec, the per-layer block spec with MoE
    layers; its MTP block when ``mtp_num_layers``), every parameter perturbed: replicated ones alike on every TP
    rank, shards per rank, each expert by its global number."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from tests.mcore_cpu import _config, _global_seed
    from tests.test_megatron_mla import _CoreAttention

    mla = getattr(args, "multi_latent_attention", False)
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    cfg = _mla_config(args, tp, pp, ep) if mla else _config(args, tp, pp, ep)
    depths = getattr(args, "mtp_num_layers", None)
    if depths:
        cfg = dataclasses.replace(cfg, mtp_num_layers=depths, mtp_loss_scaling_factor=args.mtp_loss_scaling_factor)
    if getattr(args, "num_experts", None):
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=args.normalization,
                                          pp_rank=ps.get_pipeline_model_parallel_rank())
        layers = spec.layer_specs
    else:
        spec = get_gpt_layer_local_spec(multi_latent_attention=mla, qk_layernorm=getattr(args, "qk_layernorm", False),
                                        normalization=args.normalization)
        layers = [spec]
    for layer in layers if mla else []:
        layer.submodules.self_attention.submodules.core_attention = _CoreAttention
    torch.manual_seed(1)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings, parallel_output=True,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False) if depths else None)
    tp_rank, offset = ps.get_tensor_model_parallel_rank(), get_transformer_layer_offset(cfg)
    experts = ps.get_expert_model_parallel_rank() * (getattr(args, "num_experts", None) or 0) // ep
    with torch.no_grad():  # the MTP stage's copy of the embedding perturbed as the embedding: they stay equal
        for name, p in model.named_parameters():
            sharded = getattr(p, "tensor_model_parallel", False)
            seed = _global_seed(name, offset, False, experts) + (tp_rank + 1 if sharded else 0)
            g = torch.Generator().manual_seed(seed)
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    if not model.pre_process and depths:  # the MTP stage ties its copy of the embedding over the DP x CP group,
        plain = model.sharded_state_dict  # which Megatron-LM's training loop passes in the metadata

        def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
            group = ps.get_data_parallel_group(with_context_parallel=True)
            return plain(prefix, sharded_offsets, {**(metadata or {}), "dp_cp_group": group})
        model.sharded_state_dict = sharded_state_dict
    return model.train()


def _train(args, **ddp_options):
    """megatron-core's model of ``args`` after STEPS steps of its own loss (the MTP losses added by its MTP
    block) with its distributed optimizer (a ChainedOptimizer of the dense and the expert one at EP > 1)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from tests.mcore_cpu import _global_seed
    from tests.mcore_train import OPTIMIZER

    model = _build(args)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                              **ddp_options), model)
    opt = get_megatron_optimizer(OptimizerConfig(**OPTIMIZER, use_distributed_optimizer=True), [ddp])
    b, s = TOKENS.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    offset, tp_rank = get_transformer_layer_offset(model.config), ps.get_tensor_model_parallel_rank()
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        if args.pipeline_model_parallel_size == 1:
            ddp(TOKENS, torch.arange(s).expand(b, s), mask, labels=TOKENS.roll(-1, dims=1),
                loss_mask=torch.ones(b, s)).mean().backward()
            ddp.finish_grad_sync()
        else:  # gradients set by hand (no pipeline schedule needed), alike on both copies of the embedding
            for n, p in model.named_parameters():
                sharded = getattr(p, "tensor_model_parallel", False)
                seed = _global_seed(n, offset, False) + 7 * step + (tp_rank + 1 if sharded else 0)
                p.main_grad.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
        assert opt.step()[0]
    return model, opt


def _train_and_save(rank: int, world: int, root: str) -> dict:
    """Each case trained by megatron-core at its TP (and EP) on 4 ranks, DP the rest (the same tokens on every
    DP rank), saved as Megatron-LM saves the ``dp_reshardable`` state; this rank's records of its optimizer's
    own state (tests/mcore_train.py: each DP rank's slices of the parameters it owns)."""
    from tests.mcore_cpu import cpu_shim, optimizer_cpu_shim, save_megatron, save_megatron_legacy
    from tests.mcore_train import MEGATRON_LM_METADATA, optimizer_records

    cpu_shim()
    optimizer_cpu_shim()
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False  # its fp8 check asks isinstance of Transformer Engine's absent class
    out = {}
    for name, args in CASES.items():
        ps.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                     pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                                     expert_model_parallel_size=args.expert_model_parallel_size)
        options = {"overlap_grad_reduce": True, "bucket_size": BUCKETS[name]} if name in BUCKETS else {}
        model, opt = _train(args, **options)
        for sharding in SHARDINGS.get(name, DEFAULT):
            metadata = {**MEGATRON_LM_METADATA, "distrib_optim_sharding_type": sharding}
            save_megatron(model, args, os.path.join(root, name + SUFFIX[sharding]), STEPS,
                          optimizer=opt.sharded_state_dict(model.sharded_state_dict(), metadata=metadata))
        flags = {"use_distributed_optimizer": True, "overlap_grad_reduce": bool(options),
                 "ddp_bucket_size": options.get("bucket_size"),
                 "data_parallel_size": world // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)}
        save_megatron_legacy(model, argparse.Namespace(**{**vars(args), **flags}), os.path.join(root, name + "_legacy"),
                             STEPS, optimizer=opt, distributed=True)
        out[name] = optimizer_records([model], opt, args)
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("mla_optim"))
    ranks = run_ranks(_train_and_save, 4, root, timeout=240)
    return root, {name: [r for rank in ranks for r in rank[name]] for name in CASES}


@pytest.mark.parametrize(("name", "sharding"), [(n, s) for n in CASES for s in (*SHARDINGS.get(n, DEFAULT), "legacy")])
def test_optimizer_state_of_mla_and_mtp_imports(saved, name, sharding, tmp_path, capsys):
    """``from-megatron`` carries megatron-core's own distributed-optimizer state over: every parameter's Adam
    moments and fp32 main parameter (each DP rank's slices put in place, TP's shards joined), exactly, and the
    step; from its torch_dist save (dp_reshardable, and fully_reshardable where SHARDINGS says) and from its
    legacy save (distrib_optim.pt, which read the MLA and MTP orders before: its parameters are the state
    dict's, but not the expert bias, a buffer)."""
    from tests.mcore_train import reference_state

    root, records = saved
    args = CASES[name]
    want, steps = reference_state(records[name], args.swiglu)
    assert steps == {float(STEPS)}
    assert len(records[name]) < 4 * len(want["main"])  # a parameter lies on fewer than all 4 ranks (DP slices)
    out = str(tmp_path / "imported")
    assert convert(["from-megatron", "--load", os.path.join(root, name + SUFFIX[sharding]), "--save", out]) == 0
    said = capsys.readouterr().out
    note = f"Adam state of step {STEPS} imported{' (dp_reshardable)' * (sharding == 'dp_reshardable')}"
    assert note in said, said[-900:]
    ckpt = FullCheckpoint(out)
    assert ckpt.has_optimizer() and ckpt.optimizer_step() == STEPS
    names = list(want["main"])
    assert any(".linear_kv_down_proj." in n for n in names) == bool(getattr(args, "multi_latent_attention", False))
    assert any(n.startswith("mtp.layers.") for n in names) == bool(getattr(args, "mtp_num_layers", None))
    for field, per in want.items():
        full = to_megalite(list(per), per.__getitem__, "reference")
        assert sorted(full) == sorted(k for k in ckpt.keys() if not k.endswith(".expert_bias"))  # a buffer
        for key, t in full.items():
            assert torch.count_nonzero(t) > 0, (key, field)  # real gradients: the test compares something
            torch.testing.assert_close(ckpt.optim(key, field), t, rtol=0, atol=0, msg=f"{key} {field}")


def test_pretrain_continues_an_mla_mtp_run_with_its_adam_state(saved, tmp_path):
    """``pretrain_gpt.py --load`` of megatron-core's MLA + MTP save at TP2 (its dp_reshardable state read
    in-process) follows the losses of a one-process run loading the ``from-megatron`` import; a fresh optimizer
    (--no-load-optim) gives other losses, so the imported moments carry the run. (Global batch 8: the mock
    dataset must hold the 14 samples Megatron-LM consumed before and 2 more steps.)"""
    from tests.asserts import assert_rel_close
    from tests.cli_utils import continue_flags, launch_pretrain, losses

    load = os.path.join(saved[0], "mla_mtp")
    imported = str(tmp_path / "imported")
    assert convert(["from-megatron", "--load", load, "--save", imported]) == 0
    run = continue_flags(load, 4)
    direct = launch_pretrain([*run, "--load", load, "--tensor-model-parallel-size", "2"], nproc=2, timeout=150)
    assert "as a Megatron-LM checkpoint (with its Adam state;" in direct.stdout, direct.stdout[-2000:]
    got, want = losses(direct), losses(launch_pretrain([*run, "--load", imported], timeout=150))
    fresh = losses(launch_pretrain([*run, "--load", imported, "--no-load-optim"], timeout=150))
    assert sorted(got) == sorted(want) == sorted(fresh) == [3, 4]
    assert_rel_close([got[i][0] for i in got], [want[i][0] for i in got], 1e-5, "in-process TP2 vs imported TP1")
    assert abs(fresh[4][0] - want[4][0]) > 1e-4 * abs(want[4][0])  # the imported moments change the next step


class _Renamed:
    """A checkpoint source under other model key names (``rename``), at the reader's interface."""

    def __init__(self, src, rename) -> None:
        self.src, self.old = src, {rename(k): k for k in src.keys()}

    def keys(self) -> list[str]:
        return list(self.old)

    def shape(self, key: str):
        return self.src.shape(self.old[key])

    def tensor(self, key: str):
        return self.src.tensor(self.old[key])

    def __getattr__(self, name: str):
        return getattr(self.src, name)


def test_dp_reshardable_state_of_transformer_engines_mla_spec_imports(saved):
    """Transformer Engine's MLA spec fuses the latent norms into the up-projections (their ``layer_norm_weight``
    registered before their weight) and a dense layer's pre-MLP norm into fc1. megatron-core builds it only with
    Transformer Engine, so the TP1 DeepSeek-V3-kind save (EP1: one buffer, the experts after each router; TP1: the
    down-projections whole, as that spec keeps them) is re-laid into that order and renamed as that spec keys
    it: read with ``transformer_impl transformer_engine`` it gives the local read's state, every field exactly."""
    import re

    from megalite.checkpointing.megatron.names import split_optimizer_keys
    from megalite.checkpointing.megatron.torch_dist.dp_optim import _ordered, dp_reshardable_state
    from megalite.checkpointing.megatron.torch_dist.dp_stages import split_expert_keys
    from megalite.checkpointing.megatron.torch_dist.reader import DistCheckpoint
    from tests.megatron_relaid import RelaidBuffers

    src = DistCheckpoint(os.path.join(saved[0], "deepseek_ep1", f"iter_{STEPS:07d}"))
    keys, args = split_optimizer_keys(src.keys())[0], src.common["args"]
    dense = {k[:-len(".mlp.linear_fc1.weight")] for k in keys if k.endswith(".mlp.linear_fc1.weight")}

    def rename(key: str) -> str:
        key = re.sub(r"\.self_attention\.(q|kv)_layernorm\.(weight|bias)$",
                     r".self_attention.linear_\1_up_proj.layer_norm_\2", key)
        head, _, tail = key.partition(".pre_mlp_layernorm.")
        return f"{head}.mlp.linear_fc1.layer_norm_{tail}" if tail and head in dense else key

    te_keys = [rename(k) for k in keys]
    assert any(k.endswith("linear_q_up_proj.layer_norm_weight") for k in te_keys)
    assert any(k.endswith("0.mlp.linear_fc1.layer_norm_weight") for k in te_keys)  # the dense layers' fused norm
    rank = {p[0]: i for i, p in enumerate(_ordered(_Renamed(src, rename), split_expert_keys(te_keys)[0], True, True))}
    layer = [f"decoder.layers.0.{n}" for n in (  # megatron-core's registration order in that spec
        "input_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_q_down_proj.weight",
        "self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.linear_q_up_proj.weight",
        "self_attention.linear_kv_down_proj.weight", "self_attention.linear_kv_up_proj.layer_norm_weight",
        "self_attention.linear_kv_up_proj.weight", "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight")]
    assert [rank[n] for n in layer] == list(range(rank[layer[0]], rank[layer[0]] + len(layer)))
    expert = re.compile(r"^(.+)\.mlp\.experts\.local_experts\.(\d+)\.linear_(fc[12])\.weight$")

    def te_order(name: str) -> tuple:
        m = expert.match(name)
        if m is None:
            return rank[rename(name)], 0, 0, ""
        return max(i for n, i in rank.items() if n.startswith(f"{m[1]}.mlp.router.")), 1, int(m[2]), m[3]

    relaid = RelaidBuffers(src, args, te_order)
    assert relaid.tensors and all(not torch.equal(t, src.tensor(k)) for k, t in relaid.tensors.items())
    te = _Renamed(relaid, rename)
    expected, step = dp_reshardable_state(src, keys, args)
    te_args = argparse.Namespace(**{**vars(args), "transformer_impl": "transformer_engine"})
    got = dp_reshardable_state(te, te_keys, te_args)
    assert not isinstance(got, str), got
    assert got[1] == step
    for field, per in expected.items():
        want = to_megalite(list(per), per.__getitem__, "local")
        have = to_megalite(list(got[0][field]), got[0][field].__getitem__, "te")
        assert sorted(have) == sorted(want), field
        assert all(torch.equal(have[k], t) for k, t in want.items()), field
    assert isinstance(dp_reshardable_state(te, te_keys, args), str)  # the fused names have no place in the local order
