"""Promise (model/mtp.py): multi-token prediction with Megatron-LM's semantics. A megatron-core GPT with two MTP
depths, built and run on CPU by megatron-core itself, and megalite's model holding its weights give the same main
and per-depth MTP losses and the same gradients of main + factor / depths x the MTP losses (masked labels
included); PP2 (the last stage's MTP looks tokens up in its tied copy of the embedding) and TP2 + SP give the
serial loss, grad-norm and "mtp_1 loss" curves under NCCL's point-to-point rules, and so do CP2 with p2p, a2a and
allgather (the shifts of the whole sequence across the zigzag chunks), packed documents per token included,
interleaved 1F1B and ZB-V over 2 virtual stages per rank, and on 4 ranks CP4 a2a+p2p (2 x 2), CP2 x PP2 and
CP2 x TP2 + SP; MTP changes the curve; a checkpoint saved at PP2 resumes in one process on the serial curve;
the flag rules."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from megalite.config import validate
from megalite.config.arguments import MegaliteConfig
from megalite.config.model import ModelConfig
from megalite.config.validate import ConfigError
from megalite.model.forward_step import lm_forward_step
from megalite.model.gpt import GPTModel
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.random import RNGTracker
from tests.asserts import assert_rel_close
from tests.harness import run_ranks
from tests.layouts import assert_matches_serial, layout_curves, p2p_mode, serial_curve
from tests.tp_utils import LLAMA_GQA, layout_flat

DEPTHS, FACTOR, SEQ, VOCAB = 2, 0.3, 16, 64


def _mcore(rank: int, world: int, save: str) -> dict:
    """megatron-core's GPT (local spec, Llama-like, untied) with MTP: one forward and backward of the masked
    mean loss; MTPLossAutoScaler adds factor / depths x each depth's masked mean to the gradient. The model is
    saved by megatron-core in ``save`` (torch_dist) with Megatron-LM's args."""
    from tests.mcore_cpu import _config, cpu_shim, save_megatron

    cpu_shim()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel as McoreGPT
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from tests.test_megatron_import import megatron_args

    ps.initialize_model_parallel(1, 1)
    args = megatron_args(ffn_hidden_size=48, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                         add_bias_linear=False, untie_embeddings_and_output_weights=True, padded_vocab_size=VOCAB)
    cfg = dataclasses.replace(_config(args, 1, 1), mtp_num_layers=DEPTHS, mtp_loss_scaling_factor=FACTOR)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    torch.manual_seed(0)
    model = McoreGPT(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False),
                     share_embeddings_and_output_weights=False, position_embedding_type="rope")
    with torch.no_grad():  # norms perturbed too, so that each one matters
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    text = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(5))
    tokens, labels = text[:, :-1], text[:, 1:]
    mask = torch.ones(2, SEQ)
    mask[0, 5], mask[1, 12:] = 0, 0
    causal = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
    per_token = model(tokens, torch.arange(SEQ).expand(2, SEQ), causal, labels=labels, loss_mask=mask)
    loss = (per_token * mask).sum() / mask.sum()
    loss.backward()
    out = {"state": {n: p.detach().clone() for n, p in model.named_parameters()},
           "grads": {n: p.grad.clone() for n, p in model.named_parameters()}, "loss": loss.detach(),
           "mtp": MTPLossLoggingHelper.tracker["values"].clone(), "tokens": tokens, "labels": labels, "mask": mask}
    args.mtp_num_layers, args.mtp_loss_scaling_factor = DEPTHS, FACTOR
    save_megatron(model, args, save, iteration=3)
    ps.destroy_model_parallel()
    return out


NAMES = [(r"^decoder\.final_layernorm", "final_norm"), (r"^decoder\.", ""), (r"\.transformer_layer\.", ".layer."),
         (r"\.final_layernorm", ".final_norm"), (r"^embedding\.word_embeddings", "embedding.word"),
         (r"input_layernorm", "input_norm"), (r"self_attention\.linear_qkv", "attention.qkv"),
         (r"self_attention\.linear_proj", "attention.proj"), (r"pre_mlp_layernorm", "pre_mlp_norm"),
         (r"linear_fc", "fc")]


def _ours(name: str) -> str:
    for pattern, repl in NAMES:
        name = re.sub(pattern, repl, name)
    return name


MODEL = dict(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, kv_channels=8, seq_length=SEQ,
             position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
             untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
             make_vocab_size_divisible_by=VOCAB)


@pytest.fixture(scope="module")
def mcore(tmp_path_factory) -> dict:
    pytest.importorskip("megatron.core")
    save = str(tmp_path_factory.mktemp("mcore_mtp"))
    return {**run_ranks(_mcore, 1, save, timeout=120)[0], "saved": save}


def _loss_and_grads(model: GPTModel, mcore: dict) -> tuple[torch.Tensor, torch.Tensor]:
    mb = {"tokens": mcore["tokens"], "labels": mcore["labels"], "loss_mask": mcore["mask"]}
    loss = lm_forward_step(model, mb, None)
    loss.backward()
    return loss.detach(), model.mtp_losses.sums.float() / model.mtp_losses.microbatches


def test_megatron_core_mtp_gives_megalites_losses_and_gradients(mcore):
    cfg = ModelConfig(**MODEL, mtp_num_layers=DEPTHS, mtp_loss_scaling_factor=FACTOR)
    model = GPTModel(cfg, BuildContext(ProcessGroups.single(), RNGTracker()), VOCAB)
    ours = dict(model.named_parameters())
    assert sorted(ours) == sorted(_ours(n) for n in mcore["state"])
    with torch.no_grad():
        for n, t in mcore["state"].items():
            ours[_ours(n)].copy_(t)
    loss, logged = _loss_and_grads(model, mcore)
    torch.testing.assert_close(loss, mcore["loss"], rtol=0, atol=1e-5)
    torch.testing.assert_close(logged, mcore["mtp"], rtol=0, atol=1e-5)
    for n, g in mcore["grads"].items():
        torch.testing.assert_close(ours[_ours(n)].grad, g, rtol=0, atol=1e-5, msg=n)


def test_from_megatron_imports_megatron_cores_mtp_checkpoint(mcore, tmp_path):
    """A torch_dist checkpoint megatron-core saved of its MTP model: from-megatron reads --mtp-num-layers and the
    factor from its args and the depths' tensors (mtp.layers.K.*), and the imported model gives megatron-core's
    main and MTP losses."""
    from megalite.checkpointing.load import load_checkpoint
    from megalite.checkpointing.metadata import model_config
    from megalite.checkpointing.reader import CheckpointReader
    from tools.convert_checkpoint import main as convert

    out = str(tmp_path / "imported")
    assert convert(["from-megatron", "--load", mcore["saved"], "--save", out]) == 0
    config = CheckpointReader(out).config
    assert (config["mtp_num_layers"], config["mtp_loss_scaling_factor"]) == (DEPTHS, FACTOR)
    cfg, vocab = model_config(config)
    model = GPTModel(cfg, BuildContext(ProcessGroups.single(), RNGTracker()), vocab)
    load_checkpoint(out, [model], None, ProcessGroups.single(), config, load_optim=False, load_rng=False)
    loss, logged = _loss_and_grads(model, mcore)
    torch.testing.assert_close(loss, mcore["loss"], rtol=0, atol=1e-5)
    torch.testing.assert_close(logged, mcore["mtp"], rtol=0, atol=1e-5)


# ---- layouts, checkpoint ---------------------------------------------------------------------------------------

ITERS = 4
MTP = {**LLAMA_GQA, "mtp_num_layers": 1}


def flat(tp: int = 1, pp: int = 1, **extra) -> dict:
    return layout_flat(MTP, vocab=256, iters=ITERS, tp=tp, pp=pp, **extra)


def _mtp_curve(res, pg) -> list:
    return res.mtp_losses


PACKED = {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True,
          "calculate_per_token_loss": True}
LAYOUTS = {"pp2": flat(pp=2), "tp2_sp": flat(tp=2, sequence_parallel=True),
           # the zigzag chunks' shifted tokens, labels and loss mask are the whole sequence's (model/mtp.py: Shifts)
           "cp2_p2p": flat(context_parallel_size=2), "cp2_a2a": flat(context_parallel_size=2, cp_comm_type="a2a"),
           "cp2_allgather": flat(context_parallel_size=2, cp_comm_type="allgather"),
           # packed documents (the shifts cross document ends as serially; the masked EODs shift too), per token
           "cp2_packed_per_token": flat(context_parallel_size=2, **PACKED),
           # virtual stages: interleaved 1F1B and ZB-V (4 layers, one per chunk; the depth on the last chunk)
           "pp2_vp2": flat(pp=2, num_layers=4, num_layers_per_virtual_pipeline_stage=1),
           "pp2_zbv": flat(pp=2, num_layers=4, pipeline_schedule="zbv")}


def serial_of(layout: str) -> dict:
    """The layout's serial run."""
    if layout in ("pp2_vp2", "pp2_zbv"):
        return flat(num_layers=4)
    return flat(**PACKED) if layout == "cp2_packed_per_token" else flat()


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[list, str]:
    save = str(tmp_path_factory.mktemp("mtp_ckpt"))
    runs = {**LAYOUTS, "pp2_save": flat(pp=2, train_iters=2, save=save, save_interval=2)}
    with p2p_mode("nccl_semantics"):
        return layout_curves(2, runs, extract={k: _mtp_curve for k in LAYOUTS}), save


# on 4 ranks: hierarchical CP (a2a within pairs, p2p between them, as Megatron-LM's a2a+p2p), and CP2 with PP2 and
# with TP2 + SP (the shifts gathered over the CP group only, the losses logged by the last stage's first TP rank)
LAYOUTS4 = {"cp4_a2a_p2p": flat(context_parallel_size=4, cp_comm_type="a2a+p2p",
                                hierarchical_context_parallel_sizes=[2, 2]),
            "cp2_pp2": flat(pp=2, context_parallel_size=2),
            "cp2_tp2_sp": flat(tp=2, sequence_parallel=True, context_parallel_size=2)}


@pytest.fixture(scope="module")
def launched4() -> list:
    with p2p_mode("nccl_semantics"):
        return layout_curves(4, LAYOUTS4, extract={k: _mtp_curve for k in LAYOUTS4})


def _assert_layout(curves: list, layout: str) -> None:
    ref = serial_curve(serial_of(layout), _mtp_curve)  # one serial run per session, shared by every layout
    assert_matches_serial(curves, layout, ref, ITERS)
    last = curves[-1][layout].extra  # the logging rank's "mtp_1 loss" lines (--log-interval 5: the last iteration)
    assert [i for i, _ in last] == [ITERS] and [i for i, _ in ref.extra] == [ITERS]
    assert_rel_close(last[0][1], ref.extra[0][1], 1e-5, f"{layout}: mtp_1 loss vs serial")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_give_the_serial_curve_and_mtp_loss(launched, layout):
    _assert_layout(launched[0], layout)


@pytest.mark.parametrize("layout", list(LAYOUTS4))
def test_four_rank_layouts_give_the_serial_curve_and_mtp_loss(launched4, layout):
    _assert_layout(launched4, layout)


def test_mtp_changes_the_curve():
    with_mtp = serial_curve(flat(), _mtp_curve)
    without = serial_curve({k: v for k, v in flat().items() if k != "mtp_num_layers"})
    assert with_mtp.losses[0] == without.losses[0]  # the reported lm loss leaves MTP out
    assert with_mtp.losses[1:] != without.losses[1:]  # but its gradient moves the model
    assert 3.0 < with_mtp.extra[0][1][0] < 8.0


def test_a_pp2_checkpoint_resumes_in_one_process_on_the_serial_curve(launched):
    _, save = launched
    resumed = serial_curve({**flat(), "load": save})
    assert_rel_close(resumed.losses, serial_curve(flat(), _mtp_curve).losses[2:], 1e-5, "resumed vs serial")


@pytest.mark.parametrize("change, named", [
    ({"mtp_loss_scaling_factor": 0.2}, "--mtp-loss-scaling-factor needs --mtp-num-layers"),
    ({"mtp_num_layers": 1, "position_embedding_type": "learned_absolute"}, "--mtp-num-layers needs"),
    ({"mtp_num_layers": 0}, "--mtp-num-layers")])
def test_the_flag_rules(change, named):
    base = {k: v for k, v in flat().items() if k != "mtp_num_layers"}
    with pytest.raises(ConfigError, match=re.escape(named)):
        validate(MegaliteConfig.from_flat({**base, **change}), 2)


# ---- planner ----------------------------------------------------------------------------------------------------

PLANNED = {"dense": {**LLAMA_GQA, "mtp_num_layers": 2},
           "moe": {**LLAMA_GQA, "mtp_num_layers": 1, "num_experts": 4, "moe_ffn_hidden_size": 32,
                   "moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid"}}


@pytest.mark.parametrize("model", list(PLANNED))
@pytest.mark.parametrize("pp", [1, 2])
def test_the_planners_count_is_the_built_models(model, pp):
    """The last stage's parameters (MTP's depths, and at PP2 untied the embedding copy) as built, and the MTP
    module counted apart from the main model's total."""
    from megalite.planning import mtp
    from megalite.planning.memory import layer_params, norm_params, stage_params, total_params
    from megalite.planning.shape import RunShape

    cfg = MegaliteConfig.from_flat({**PLANNED[model], "pipeline_model_parallel_size": pp, "vocab_size": 256})
    built = GPTModel(cfg.model, BuildContext(ProcessGroups.single(), RNGTracker()), 256,
                     layer_numbers=[1] if pp == 2 else None, pre_process=pp == 1)
    params = dict(built.named_parameters())
    sh = RunShape.of(cfg, pp, 256)
    assert stage_params(sh, pp - 1) == sum(p.numel() for p in params.values())
    in_mtp = sum(p.numel() for n, p in params.items() if n.startswith("mtp"))  # mtp.* and mtp_embedding
    assert ("mtp_embedding.weight" in params) == (pp == 2) and mtp.all_params(sh, layer_params, norm_params) == in_mtp
    if pp == 1:
        assert total_params(sh) == sum(p.numel() for p in params.values()) - in_mtp


@pytest.mark.parametrize("command, named", [("to-hf", "--mtp-num-layers")])
def test_conversions_refuse_mtp_by_name(launched, tmp_path, capsys, command, named):
    """to-hf does not drop the MTP depths silently (no adapter but DeepSeek-V3's carries them; to-megatron writes
    them: tests/test_megatron_mtp_export.py)."""
    from tools.convert_checkpoint import main as convert

    _, save = launched
    assert convert([command, "--load", save, "--save", str(tmp_path / "out")]) == 2
    assert named in capsys.readouterr().err


def test_full_recomputation_recomputes_the_mtp_layers_with_the_same_gradients():
    """--recompute-granularity full (uniform) recomputes each depth, as megatron-core does; same gradients."""
    grads = []
    for extra in ({}, {"recompute_granularity": "full"}):
        cfg = ModelConfig(**MODEL, mtp_num_layers=DEPTHS, **extra)
        model = GPTModel(cfg, BuildContext(ProcessGroups.single(), RNGTracker()), VOCAB)
        torch.manual_seed(1)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(0.1 * torch.randn_like(p) + (1.0 if "norm" in n else 0.0))
        assert model.mtp.recomputed == bool(extra)
        text = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(2))
        lm_forward_step(model, {"tokens": text[:, :-1], "labels": text[:, 1:], "loss_mask": torch.ones(2, SEQ)},
                        None).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-6, atol=1e-7, msg=n)


def test_the_mtp_term_follows_megatrons_normalisation():
    """Depth k's losses count where the loss mask shifted k ahead is set: the term is F / D x each depth's mean
    over its shifted mask, or with --calculate-per-token-loss its sum over the main loss's token count; the
    logged loss is the mean in both cases."""
    from megalite.model.mtp import mtp_loss, shift_left

    per_token = [torch.arange(12.0).view(2, 6), 10 + torch.arange(12.0).view(2, 6)]
    mask = torch.tensor([[1.0, 1, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    assert shift_left(mask, 2).tolist() == [[0, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]]
    means = [(x * shift_left(mask, k + 1)).sum() / shift_left(mask, k + 1).sum() for k, x in enumerate(per_token)]
    term, logged = mtp_loss(per_token, mask, None, 0.5)
    torch.testing.assert_close(term, 0.25 * (means[0] + means[1]))
    torch.testing.assert_close(torch.stack(logged), torch.stack(means))
    sums = [(x * shift_left(mask, k + 1)).sum() for k, x in enumerate(per_token)]
    term, logged = mtp_loss(per_token, mask, torch.tensor(7.0), 0.5)
    torch.testing.assert_close(term, 0.25 * (sums[0] + sums[1]) / 7)
    torch.testing.assert_close(torch.stack(logged), torch.stack(means))


def test_the_log_line_names_each_depths_loss_as_megatron_does():
    from megalite.training.log import IterationLine, format_iteration_line

    line = format_iteration_line(IterationLine(iteration=3, train_iters=10, consumed=24, elapsed_ms=1.0, lr=1e-3,
                                               global_batch=8, loss=4.5, loss_scale=1.0, grad_norm=1.0, skipped=0,
                                               nan=0, mtp=[4.75, 5.0]))
    assert "| lm loss: 4.500000E+00 | mtp_1 loss: 4.750000E+00 | mtp_2 loss: 5.000000E+00 | loss scale: 1.0 |" in line


def test_printed_model_flags_carry_the_mtp_factor():
    """convert_checkpoint's "Continue with" flags train an imported MTP model with its own loss factor (a
    Megatron run at 0.5 would otherwise resume at the default 0.1); the default is left out."""
    import shlex

    from megalite.checkpointing.metadata import config_dict
    from megalite.config.arguments import parse_args
    from megalite.config.model import ModelConfig
    from tools.convert_checkpoint import model_flags

    for factor in (0.5, 0.1):
        cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, mtp_num_layers=2,
                          mtp_loss_scaling_factor=factor)
        text = model_flags(config_dict(cfg, 64))
        got = parse_args(["--mock-data", *shlex.split(text)]).model
        assert (got.mtp_num_layers, got.mtp_loss_scaling_factor) == (2, factor)
        assert ("--mtp-loss-scaling-factor" in text) == (factor != 0.1), text
