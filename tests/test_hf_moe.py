"""Promises of the Hugging Face conversion of MoE models (megalite/checkpointing/hf/moe.py):
- a randomly initialized transformers Mixtral and Qwen2-MoE (shared expert + sigmoid gate, q/k/v biases,
  a dense layer from mlp_only_layers) imported with from_hf_state_dict give HF's logits (fp32, <= 1e-4)
  in one process and at TP2 x EP2 x PP2 with sequence parallelism on 8 ranks;
- megalite -> HF -> megalite returns bitwise identical tensors, HF -> megalite -> HF identical state dicts;
- convert_checkpoint.py from-hf (TP2 x EP2 x PP2 checkpoint) then to-hf gives the original folder's tensors back;
- the routers' semantics map (norm_topk_prob), the aux-loss coefficient maps both ways, and what megalite
  cannot express is refused naming the HF key or the megalite flag.
Models are built from configs; nothing is downloaded."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megalite.checkpointing.full_reader import FullCheckpoint
from megalite.checkpointing.hf.convert import (
    HFConversionError,
    architecture,
    from_hf_config,
    from_hf_state_dict,
    to_hf_config,
    to_hf_state_dict,
)
from megalite.checkpointing.hf.moe import moe_tp_errors
from megalite.checkpointing.metadata import model_config
from megalite.checkpointing.stored import checkpoint_key
from megalite.model.gpt import GPTModel
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.pipeline.partition import chunk_layers
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.param_meta import local_shard, param_meta
from megalite.tensor_parallel.random import RNGTracker
from tests.cli_utils import load_tool
from tests.harness import run_ranks

VOCAB, SEQ = 128, 16
convert = load_tool("convert_checkpoint").main
TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=SEQ, num_experts_per_tok=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)


def mixtral_config(**kw):
    from transformers import MixtralConfig

    return MixtralConfig(**{**COMMON, "intermediate_size": 24, "num_hidden_layers": 2, "num_local_experts": 4, **kw})


def qwen_config(**kw):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(**{**COMMON, "intermediate_size": 40, "moe_intermediate_size": 16,
                             "shared_expert_intermediate_size": 24, "num_hidden_layers": 4, "num_experts": 4,
                             "mlp_only_layers": [1], "norm_topk_prob": False, "qkv_bias": True, **kw})


def perturbed(model):
    """Random values everywhere (norms, biases, router too), so no mapping error hides behind 1s and 0s."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.1) + (p.dim() == 1))
    return model.eval()


def hf_model(name: str):
    import transformers

    cfg = mixtral_config() if name == "mixtral" else qwen_config()
    cls = transformers.MixtralForCausalLM if name == "mixtral" else transformers.Qwen2MoeForCausalLM
    torch.manual_seed(0)
    return perturbed(cls(cfg))


@pytest.fixture(scope="module")
def models() -> dict:
    """name -> (HF model, its logits, megalite config dict, megalite full tensors)."""
    out = {}
    for name in ("mixtral", "qwen2_moe"):
        model = hf_model(name)
        with torch.no_grad():
            logits = model(TOKENS).logits
        config = from_hf_config(model.config)
        out[name] = (model, logits, config, from_hf_state_dict(config, model.state_dict()))
    return out


def fill(chunk: GPTModel, full: dict[str, torch.Tensor], pg: ProcessGroups) -> None:
    """Every parameter of ``chunk`` from the full tensors: this rank's part of its checkpoint key's tensor."""
    with torch.no_grad():
        for n, p in chunk.named_parameters():
            p.copy_(local_shard(param_meta(p), full[checkpoint_key(n, p)], pg))


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape == (*TOKENS.shape, VOCAB), what
    assert want.std() > 0.05, f"{what}: logits too flat for the comparison to mean anything"
    diff = (got - want).abs().max().item()
    assert diff <= 1e-4, f"{what}: max abs logit diff {diff:.3e}"


# ---- HF -> megalite: the logits ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_from_hf_single_process_gives_the_hf_logits(models, name):
    _, want, config, full = models[name]
    cfg, vocab = model_config(config)
    pg = ProcessGroups.single()
    model = GPTModel(cfg, BuildContext(pg, RNGTracker()), vocab).eval()
    fill(model, full, pg)
    with torch.no_grad():
        assert_close(model(TOKENS), want, name)


def _layout_logits(rank: int, world: int, cases: dict) -> dict:
    """TP2 x EP2 x PP2 (sequence parallel): each case's logits on the last stage's first rank."""
    pg = ProcessGroups.build(RankLayout(world, tp=2, pp=2, ep=2), rank)
    out = {}
    for name, (config, full) in cases.items():
        cfg, vocab = model_config(config)
        model = GPTModel(cfg, BuildContext(pg, RNGTracker(), sequence_parallel=True), vocab,
                         layer_numbers=chunk_layers(cfg.num_layers, 2, 1, pg.pp_rank, 0),
                         pre_process=pg.is_first_stage, post_process=pg.is_last_stage).eval()
        fill(model, full, pg)
        b, s = TOKENS.shape
        with torch.no_grad():
            if pg.is_first_stage:
                x = model(TOKENS)
            else:
                x = torch.empty(s // pg.tp_size, b, cfg.hidden_size)
                dist.recv(x, src=pg.ranks["pp"][pg.pp_rank - 1])
                x = model(hidden=x)
        if not pg.is_last_stage:
            dist.send(x.contiguous(), dst=pg.ranks["pp"][pg.pp_rank + 1])
        out[name] = x if pg.is_last_stage and pg.tp_rank == 0 and pg.dp_rank == 0 else None
        out[name + "_ep"] = (pg.ep_size, pg.tp_size, pg.pp_size)
    return out


def test_from_hf_at_tp2_ep2_pp2_gives_the_hf_logits(models):
    cases = {name: (config, full) for name, (_, _, config, full) in models.items()}
    results = run_ranks(_layout_logits, 8, cases, timeout=180)
    for name, (_, want, _, _) in models.items():
        assert {r[name + "_ep"] for r in results} == {(2, 2, 2)}
        got = [r[name] for r in results if r[name] is not None]
        assert len(got) == 1, name
        assert_close(got[0], want, f"{name} at TP2 x EP2 x PP2")


# ---- round trips ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_hf_megalite_hf_round_trip_is_identical(models, name):
    model, _, config, full = models[name]
    sd = model.state_dict()
    back = to_hf_state_dict(config, full.__getitem__)
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    hf = to_hf_config(config)
    assert type(hf) is type(model.config)
    for key in ("num_hidden_layers", "num_experts_per_tok", "intermediate_size", "router_aux_loss_coef",
                "num_key_value_heads", "tie_word_embeddings"):
        assert getattr(hf, key) == getattr(model.config, key), key
    assert from_hf_config(hf) == config


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_megalite_hf_megalite_round_trip_is_bitwise(models, name):
    _, _, config, full = models[name]
    gen = torch.Generator().manual_seed(11)
    ours = {k: torch.randn(v.shape, generator=gen) for k, v in full.items()}  # not HF's values
    back = from_hf_state_dict(config, to_hf_state_dict(config, ours.__getitem__))
    assert set(back) == set(ours)
    for k, v in ours.items():
        assert torch.equal(back[k], v), k


def test_stacked_experts_are_megalites_gate_up_layout(models):
    """HF's gate_up_proj [E, 2F, h] (gate rows first) is megalite's fc1_weight; down_proj [E, h, F] fc2."""
    model, _, _, full = models["qwen2_moe"]
    experts = model.model.layers[0].mlp.experts
    assert tuple(full["layers.0.mlp.experts.fc1_weight"].shape) == (4, 32, 32)
    assert tuple(full["layers.0.mlp.experts.fc2_weight"].shape) == (4, 32, 16)
    assert torch.equal(full["layers.0.mlp.experts.fc1_weight"], experts.gate_up_proj)
    assert "layers.1.mlp.fc1.weight" in full and "layers.1.mlp.router.weight" not in full  # the dense layer


# ---- configs --------------------------------------------------------------------------------------------


def test_configs_map_router_layers_and_aux_coefficient():
    mix = from_hf_config(mixtral_config(router_aux_loss_coef=0.02))
    assert (mix["num_experts"], mix["moe_router_topk"], mix["moe_router_pre_softmax"]) == (4, 2, False)
    assert mix["moe_aux_loss_coeff"] == pytest.approx(0.02 * 2 / 2)  # coef x k / MoE layers
    assert architecture(model_config(mix)[0]) == "mixtral"
    qwen = from_hf_config(qwen_config(decoder_sparse_step=2, mlp_only_layers=[]))
    assert qwen["moe_layer_freq"] == "[0,1,0,1]"  # HF's (i + 1) % step; megalite's int counts from layer 0
    assert qwen["moe_router_pre_softmax"] and qwen["add_qkv_bias"] and qwen["moe_shared_expert_gate"]
    assert qwen["moe_aux_loss_coeff"] == pytest.approx(0.001 * 2 / 2)
    assert to_hf_config(qwen).mlp_only_layers == [0, 2]
    normed = from_hf_config(qwen_config(norm_topk_prob=True))
    assert not normed["moe_router_pre_softmax"]  # renormalised top-k of the softmax = softmax of the top-k
    assert to_hf_config(normed).norm_topk_prob


@pytest.mark.parametrize("make, key", [
    (lambda: mixtral_config(sliding_window=8), "sliding_window 8"),
    (lambda: qwen_config(use_sliding_window=True, sliding_window=8), "use_sliding_window"),
    (lambda: qwen_config(shared_expert_intermediate_size=0), "shared_expert_intermediate_size 0"),
    (lambda: qwen_config(hidden_act="gelu"), "hidden_act 'gelu'"),
    (lambda: mixtral_config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
     "rope_type 'linear'"),
])
def test_unsupported_hf_features_are_refused_by_name(make, key):
    with pytest.raises(HFConversionError, match=key):
        from_hf_config(make())


@pytest.mark.parametrize("make, expected", [
    (lambda: mixtral_config(num_experts_per_tok=5), "num_experts_per_tok 5, num_local_experts 4: --moe-router-topk (5) "
                                                    "must be between 1 and --num-experts (4)"),
    (lambda: qwen_config(num_experts_per_tok=0), "num_experts_per_tok 0: --moe-router-topk must be an integer in [1, "),
    (lambda: mixtral_config(num_local_experts=-2), "num_local_experts -2: --num-experts must be an integer in [1, "),
    (lambda: mixtral_config(hidden_size=30), "hidden_size 30, num_attention_heads 4: --hidden-size (30) must be "
                                             "divisible by --num-attention-heads (4)"),
])
def test_hf_moe_configs_pass_the_training_flags_rules(make, expected):
    """More experts per token than experts (and other values the training flags refuse) are refused at
    conversion by config/validate_moe.py's rules, naming the HF keys, not later in generation."""
    with pytest.raises(HFConversionError) as e:
        from_hf_config(make())
    assert str(e.value).startswith("config.json: ") and expected in str(e.value)


@pytest.mark.parametrize("change, expected", [
    ({"num_experts_per_tok": 5}, "num_experts_per_tok 5, num_local_experts 4: --moe-router-topk (5) must be between"),
    ({"num_local_experts": 3}, "tensor model.layers.0.block_sparse_moe.experts.3.w1.weight (and 5 more) has no "
                               "place in the model"),
    ({"intermediate_size": 20}, "tensor model.layers.0.block_sparse_moe.experts.0.w1.weight has shape [24, 32], but "
                                "{folder}/config.json makes it [20, 32]"),
])
def test_from_hf_refuses_an_moe_folder_by_name(change, expected, tmp_path, capsys):
    """Through the command, on the per-expert files transformers writes: fewer experts declared than stored is
    refused naming the first unused expert file (nothing dropped), a contradicting size names file and shapes."""
    import json
    import os

    folder = str(tmp_path / "hf")
    hf_model("mixtral").save_pretrained(folder)
    path = os.path.join(folder, "config.json")
    json.dump({**json.load(open(path)), **change}, open(path, "w"))
    assert convert(["from-hf", "--load", folder, "--save", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and expected.format(folder=folder) in err, err
    assert not (tmp_path / "ck").exists()


def test_router_jitter_is_a_training_only_warning():
    with pytest.warns(UserWarning, match="router_jitter_noise 0.1.*only matters for training"):
        config = from_hf_config(mixtral_config(router_jitter_noise=0.1))
    assert config["num_experts"] == 4


@pytest.mark.parametrize("change, flag", [
    ({"moe_shared_expert_gate": False}, "--moe-shared-expert-gate"),
    ({"moe_shared_expert_intermediate_size": None, "moe_router_pre_softmax": True}, "no --moe-router-pre-softmax"),
    ({"moe_router_score_function": "sigmoid"}, "--moe-router-score-function softmax"),
    ({"moe_router_topk_scaling_factor": 2.0}, "no --moe-router-topk-scaling-factor"),
])
def test_megalite_moe_without_hf_equivalent_is_refused_by_flag(models, change, flag):
    config = {**models["qwen2_moe"][2], **change}
    with pytest.raises(HFConversionError, match=f"missing: [^;]*{flag}"):
        to_hf_config(config)


def test_expert_sizes_must_split_over_the_checkpoints_tp():
    cfg = model_config(from_hf_config(qwen_config(moe_intermediate_size=18, shared_expert_intermediate_size=22)))[0]
    errors = moe_tp_errors(cfg, 4)
    assert len(errors) == 2 and "--moe-ffn-hidden-size 18" in errors[0] and "(22)" in errors[1]
    assert moe_tp_errors(cfg, 2) == []


# ---- the command line -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_convert_commands_from_hf_tp2_ep2_pp2_then_to_hf(models, name, tmp_path):
    """from-hf writes a TP2 x EP2 x PP2 checkpoint whose full tensors are the conversion's; to-hf gives the same
    transformers model back (bitwise), which transformers loads and runs to the same logits."""
    import transformers

    model, want, _, full = models[name]
    src, ckpt, out = (str(tmp_path / n) for n in ("hf", "ckpt", "back"))
    model.save_pretrained(src)
    assert convert(["from-hf", "--load", src, "--save", ckpt, "--tensor-model-parallel-size", "2",
                    "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]) == 0
    saved = FullCheckpoint(ckpt)
    assert (saved.layout["tp"], saved.layout["pp"], saved.layout["ep"]) == (2, 2, 2)
    assert set(saved.keys()) == set(full) and all(torch.equal(saved.param(k), v) for k, v in full.items())
    assert convert(["to-hf", "--load", ckpt, "--save", out]) == 0
    back = getattr(transformers, model.config.architectures[0]).from_pretrained(out, local_files_only=True).eval()
    assert type(back) is type(model)
    sd = model.state_dict()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in sd.items()) and set(back.state_dict()) == set(sd)
    with torch.no_grad():
        assert_close(back(TOKENS).logits, want, f"{name} after from-hf / to-hf")


def test_convert_to_hf_refuses_an_moe_without_equivalent_before_writing(tmp_path, capsys):
    from megalite.checkpointing.writer import write_checkpoint

    model = hf_model("qwen2_moe")
    config = from_hf_config(model.config)
    full = {k: v for k, v in from_hf_state_dict(config, model.state_dict()).items()
            if not k.endswith("shared_expert_gate")}
    config["moe_shared_expert_gate"] = False  # a shared expert without Qwen2-MoE's gate
    write_checkpoint(str(tmp_path / "ckpt"), config, full.__getitem__, tp=1, pp=1)
    assert convert(["to-hf", "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "out")]) == 2
    assert "(missing: --moe-shared-expert-gate)" in capsys.readouterr().err and not (tmp_path / "out").exists()


# ---- megalite -> HF: a model born in megalite ----------------------------------------------------------------


@pytest.mark.parametrize("name, flags", [
    ("mixtral", dict(kv_channels=16, untie_embeddings_and_output_weights=False)),
    ("qwen2_moe", dict(kv_channels=16, moe_layer_freq="[1,1,0,1]", moe_router_pre_softmax=False,
                       moe_aux_loss_coeff=0.01)),
])
def test_megalite_model_exports_to_the_same_logits(models, name, flags, tmp_path):
    """Head size != hidden / heads, tied embeddings, the default router on Qwen2-MoE (norm_topk_prob true):
    HF's model from to_hf_config + to_hf_state_dict, saved and loaded by transformers, computes megalite's
    logits."""
    import transformers

    from megalite.checkpointing.hf.convert import save_hf_model

    config = {**models[name][2], **flags}
    cfg, vocab = model_config(config)
    pg = ProcessGroups.single()
    model = perturbed(GPTModel(cfg, BuildContext(pg, RNGTracker()), vocab))
    with torch.no_grad():
        want = model(TOKENS)
    params = dict(model.named_parameters())
    hf_config = to_hf_config(config)
    save_hf_model(str(tmp_path), hf_config, to_hf_state_dict(config, lambda k: params[k].detach()))
    hf = getattr(transformers, hf_config.architectures[0]).from_pretrained(str(tmp_path), local_files_only=True)
    assert hf.config.head_dim == 16 and hf.config.tie_word_embeddings == cfg.tied_embeddings
    with torch.no_grad():
        assert_close(hf.eval()(TOKENS).logits, want, f"megalite {name} exported")
