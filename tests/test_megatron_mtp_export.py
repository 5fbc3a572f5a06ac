"""Promise: multi-token prediction depths go out with ``to-megatron``. A megalite checkpoint with two MTP depths
(Llama-style, random weights, saved at TP2) is exported at TP2 (torch_dist, and the legacy format cut for
TP2); megatron-core's GPTModel with its MTP block at TP2, built from the args the export saved, loads each and
gives megalite's main loss and per-depth MTP losses (fp32, 1e-5); ``from-megatron`` of the export gives the
same losses back. A depth whose layer is MoE (DeepSeek-V3's kind: dense first layer, MoE last, a shared expert,
sigmoid router with an expert bias) goes out with its experts and gives the same losses too; and megatron-core's own
TP2 checkpoint of such a model (two MoE depths, torch_dist and legacy) imports with ``from-megatron`` with its main
and per-depth MTP losses."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megalite.checkpointing.load import load_checkpoint
from megalite.checkpointing.megatron.args import config_from_args
from megalite.checkpointing.megatron.names import full_shapes
from megalite.checkpointing.megatron.safe_pickle import load_torch_file
from megalite.checkpointing.metadata import model_config
from megalite.checkpointing.reader import CheckpointReader
from megalite.checkpointing.writer import write_checkpoint
from megalite.model.forward_step import lm_forward_step
from megalite.model.gpt import GPTModel
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.random import RNGTracker
from tests.harness import run_ranks
from tests.test_megatron_import import megatron_args
from tools.convert_checkpoint import main as convert

pytest.importorskip("megatron.core")

VOCAB, SEQ = 64, 16  # exported unpadded: padded rows would join megatron-core's softmax
ARGS = megatron_args(ffn_hidden_size=48, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                     add_bias_linear=False, untie_embeddings_and_output_weights=True, mtp_num_layers=2,
                     mtp_loss_scaling_factor=0.3, seq_length=SEQ, max_position_embeddings=SEQ)
TEXT = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(5))
MASK = torch.ones(2, SEQ)
MASK[0, 5], MASK[1, 12:] = 0, 0


def _mcore_losses(rank: int, root: str, moe: bool) -> dict:
    """megatron-core at TP2 with its MTP block loads the torch_dist ("mcore") and the legacy export; (main
    masked-mean loss, per-depth MTP losses) per format, and the args each export saved. ``moe``: its per-layer
    block spec (the depth's layer is the last layer's MoE), whose MoE layers run in eval (the model trains, as
    MTP losses are logged only then, but an MoE layer's training refuses TP without SP, which torch's norms
    lack here)."""
    from tests.mcore_cpu import _config, cpu_shim

    cpu_shim()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel as McoreGPT
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    out = {}
    for fmt in ("mcore", "legacy"):
        it_dir = os.path.join(root, fmt, "iter_0000005")
        path = os.path.join(it_dir, f"mp_rank_{rank:02d}", "model_optim_rng.pt")
        saved = load_torch_file(os.path.join(it_dir, "common.pt") if fmt == "mcore" else path)
        args = saved["args"]
        cfg = dataclasses.replace(_config(args, 2, 1), mtp_num_layers=args.mtp_num_layers,
                                  mtp_loss_scaling_factor=args.mtp_loss_scaling_factor)
        spec = (get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=args.normalization)
                if moe else get_gpt_layer_local_spec(normalization=args.normalization))
        model = McoreGPT(config=cfg, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                         max_sequence_length=SEQ, share_embeddings_and_output_weights=False,
                         mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False),
                         position_embedding_type="rope")
        if fmt == "mcore":
            model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, it_dir)["model"])
        else:
            model.load_state_dict(saved["model"], strict=True)
        for m in model.modules():
            if isinstance(m, MoELayer):
                m.eval()
        MTPLossLoggingHelper.tracker.pop("values", None)  # one forward's losses per format
        tokens, labels = TEXT[:, :-1], TEXT[:, 1:]
        causal = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
        per_token = model(tokens, torch.arange(SEQ).expand(2, SEQ), causal, labels=labels, loss_mask=MASK)
        out[fmt] = ((per_token * MASK).sum() / MASK.sum()).detach(), MTPLossLoggingHelper.tracker["values"].clone()
        out[fmt + "_args"] = (args.mtp_num_layers, args.mtp_loss_scaling_factor, getattr(args, "moe_layer_freq", None))
    ps.destroy_model_parallel()
    return out if rank == 0 else {}


def _in_megatron(rank: int, world: int, root: str) -> dict:
    return _mcore_losses(rank, root, moe=False)


def _moe_in_megatron(rank: int, world: int, root: str) -> dict:
    return _mcore_losses(rank, root, moe=True)


def _megalite_losses(load: str) -> tuple[torch.Tensor, torch.Tensor]:
    config = CheckpointReader(load).config
    cfg, vocab = model_config(config)
    model = GPTModel(cfg, BuildContext(ProcessGroups.single(), RNGTracker()), vocab)
    load_checkpoint(load, [model], None, ProcessGroups.single(), config, load_optim=False, load_rng=False)
    loss = lm_forward_step(model, {"tokens": TEXT[:, :-1], "labels": TEXT[:, 1:], "loss_mask": MASK}, None)
    return loss.detach(), model.mtp_losses.sums.float() / model.mtp_losses.microbatches


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("mtp_export"))
    config = config_from_args(ARGS, VOCAB, "mtp")
    g = torch.Generator().manual_seed(7)
    params = {k: 0.1 * torch.randn(shape, generator=g) + (1.0 if "norm.weight" in k else 0.0)
              for k, shape in full_shapes(config).items()}
    assert "mtp.layers.1.eh_proj.weight" in params
    write_checkpoint(os.path.join(root, "megalite"), config, params.__getitem__, tp=2, pp=1, iteration=5)
    for out, extra in (("mcore", []), ("legacy", ["--format", "torch"])):
        assert convert(["to-megatron", "--load", os.path.join(root, "megalite"), "--save", os.path.join(root, out),
                        "--tensor-model-parallel-size", "2", "--padded-vocab-size", str(VOCAB), *extra]) == 0
    got = run_ranks(_in_megatron, 2, root, timeout=120)[0]
    assert [got[f + "_args"][:2] for f in ("mcore", "legacy")] == [(2, 0.3)] * 2  # the depths and factor go out
    return root, got


@pytest.mark.parametrize("fmt", ["mcore", "legacy"])
def test_megatron_core_gives_megalites_main_and_mtp_losses(exported, fmt):
    root, got = exported
    loss, mtp = _megalite_losses(os.path.join(root, "megalite"))
    assert mtp.shape == (2,) and (mtp > 0).all()
    torch.testing.assert_close(got[fmt][0], loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(got[fmt][1], mtp, rtol=0, atol=1e-5)


def test_from_megatron_reads_the_exported_depths_back(exported, tmp_path):
    root, _ = exported
    assert convert(["from-megatron", "--load", os.path.join(root, "mcore"), "--save", str(tmp_path / "back")]) == 0
    for got, want in zip(_megalite_losses(str(tmp_path / "back")), _megalite_losses(os.path.join(root, "megalite"))):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# DeepSeek-V3's kind: a dense first layer, an MoE last layer (so an MoE depth) with a shared expert, sigmoid
# scores and an expert bias
MOE_ARGS = megatron_args(**{**vars(ARGS), "mtp_num_layers": 1, "num_experts": 4, "moe_ffn_hidden_size": 16,
                            "moe_router_topk": 2, "moe_layer_freq": [0, 1], "moe_shared_expert_intermediate_size": 24,
                            "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                            "moe_aux_loss_coeff": 0.0, "moe_router_load_balancing_type": "none"})


def test_an_moe_depth_goes_out_with_its_experts_and_gives_the_same_losses(tmp_path):
    config = config_from_args(MOE_ARGS, VOCAB, "moe_mtp")
    g = torch.Generator().manual_seed(9)
    params = {k: 0.1 * torch.randn(shape, generator=g) + (1.0 if "norm.weight" in k else 0.0)
              for k, shape in full_shapes(config).items()}
    assert "mtp.layers.0.layer.mlp.experts.fc1_weight" in params
    write_checkpoint(str(tmp_path / "megalite"), config, params.__getitem__, tp=2, pp=1, iteration=5)
    for out, extra in (("mcore", []), ("legacy", ["--format", "torch"])):
        assert convert(["to-megatron", "--load", str(tmp_path / "megalite"), "--save", str(tmp_path / out),
                        "--tensor-model-parallel-size", "2", "--padded-vocab-size", str(VOCAB), *extra]) == 0
    got = run_ranks(_moe_in_megatron, 2, str(tmp_path), timeout=120)[0]
    assert [got[f + "_args"][0] for f in ("mcore", "legacy")] == [1, 1] and got["mcore_args"][2] == [0, 1]
    loss, mtp = _megalite_losses(str(tmp_path / "megalite"))
    assert mtp.shape == (1,) and (mtp > 0).all()
    for fmt in ("mcore", "legacy"):
        torch.testing.assert_close(got[fmt][0], loss, rtol=0, atol=1e-5)
        torch.testing.assert_close(got[fmt][1], mtp, rtol=0, atol=1e-5)


# ---- from-megatron of megatron-core's own MoE-depth model ----------------------------------------------------

# saved by megatron-core at TP2: two depths, each MoE as the last layer (DeepSeek-V3's kind)
CORE_MOE_ARGS = megatron_args(**{**vars(MOE_ARGS), "mtp_num_layers": 2, "padded_vocab_size": VOCAB,
                                 "pipeline_model_parallel_size": 1})


def _core_moe_saves(rank: int, world: int, root: str) -> dict:
    """megatron-core's GPT at TP2 with an MoE depth (dense-then-MoE per-layer spec, its MTP block from it), every
    parameter and expert bias perturbed (replicated ones alike on both TP ranks, shards per rank), saved in
    torch_dist and the legacy format by megatron-core / as Megatron-LM writes them; its masked-mean main loss and
    per-depth MTP losses on TEXT (the MoE layers in eval, as in _mcore_losses)."""
    from tests.mcore_cpu import _config, _global_seed, cpu_shim, save_megatron, save_megatron_legacy

    cpu_shim()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel as McoreGPT
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    args = CORE_MOE_ARGS
    cfg = dataclasses.replace(_config(args, 2, 1), mtp_num_layers=args.mtp_num_layers,
                              mtp_loss_scaling_factor=args.mtp_loss_scaling_factor)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=args.normalization)
    model = McoreGPT(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False))
    tp_rank = ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            sharded = getattr(p, "tensor_model_parallel", False)
            g = torch.Generator().manual_seed(_global_seed(name, 0, False) + (tp_rank + 1 if sharded else 0))
            p.add_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():  # the expert bias (a buffer) moves each layer's top-k choice
            if name.endswith("expert_bias"):
                g = torch.Generator().manual_seed(_global_seed(name, 0, False))
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    assert any(isinstance(m, MoELayer) for m in model.mtp.modules())
    for m in model.modules():
        if isinstance(m, MoELayer):
            m.eval()
    tokens, labels = TEXT[:, :-1], TEXT[:, 1:]
    causal = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
    per_token = model(tokens, torch.arange(SEQ).expand(2, SEQ), causal, labels=labels, loss_mask=MASK)
    out = {"loss": ((per_token * MASK).sum() / MASK.sum()).detach(),
           "mtp": MTPLossLoggingHelper.tracker["values"].clone()}
    save_megatron(model, args, os.path.join(root, "mcore"), iteration=4)
    save_megatron_legacy(model, args, os.path.join(root, "legacy"), iteration=4)
    ps.destroy_model_parallel()
    return out if rank == 0 else {}


@pytest.fixture(scope="module")
def core_moe(tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("core_moe_mtp"))
    return root, run_ranks(_core_moe_saves, 2, root, timeout=120)[0]


@pytest.mark.parametrize("fmt", ["mcore", "legacy"])
def test_from_megatron_imports_megatron_cores_moe_depths_with_its_losses(core_moe, fmt, tmp_path):
    """from-megatron of megatron-core's own checkpoint whose MTP depths are MoE layers (router, expert bias,
    experts, shared expert under mtp.layers.K.transformer_layer.mlp.*): megalite's main and per-depth MTP losses
    are megatron-core's (fp32, 1e-5)."""
    root, want = core_moe
    out = str(tmp_path / "imported")
    assert convert(["from-megatron", "--load", os.path.join(root, fmt), "--save", out]) == 0
    config = CheckpointReader(out).config
    assert (config["mtp_num_layers"], config["num_experts"], config["moe_layer_freq"]) == (2, 4, "[0,1]")
    assert "mtp.layers.1.layer.mlp.experts.fc1_weight" in dict(full_shapes(config))
    loss, mtp = _megalite_losses(out)
    assert mtp.shape == (2,) and (mtp > 0).all()
    torch.testing.assert_close(loss, want["loss"], rtol=0, atol=1e-5)
    torch.testing.assert_close(mtp, want["mtp"], rtol=0, atol=1e-5)
