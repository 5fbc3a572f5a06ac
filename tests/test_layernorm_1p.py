"""Promises of --apply-layernorm-1p (Megatron's zero-centred norm weights, LayerNorm and RMSNorm):
- the stored weight w starts at 0 and the norm scales by 1 + w: a model with the flag is exactly the
  model without it whose norm weights are 1 + w;
- TP=2 with sequence parallelism trains on the single-process curve (fp32, <= 1e-5);
- checkpoints store w and record the flag, so a load with the other setting is refused by name;
- to-hf writes 1 + w (HF norms hold the scale itself), from-hf --apply-layernorm-1p stores HF's - 1, and the
  round trip gives the same logits."""

from __future__ import annotations

import pytest
import torch

from megalite.checkpointing import CheckpointMismatch, load_checkpoint
from megalite.checkpointing.hf.convert import from_hf_state_dict, to_hf_state_dict
from megalite.checkpointing.load import shape_diffs
from megalite.checkpointing.metadata import config_dict
from megalite.checkpointing.reader import CheckpointReader
from megalite.config import validate
from megalite.config.arguments import MegaliteConfig
from megalite.config.model import ModelConfig
from megalite.model.build import build_model
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.random import model_parallel_seed
from megalite.training.loop import TrainResult, pretrain
from tests.asserts import assert_rel_close
from tests.cli_utils import load_tool
from tests.layouts import layout_curves, serial_curve
from tests.tp_utils import GPT2, LLAMA_GQA, build, groups_for, mock_data

VOCAB = 200
SEQ = 16
MODELS = {"gpt2": GPT2, "llama": LLAMA_GQA}  # LayerNorm, RMSNorm
TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
QUIET = lambda s: None  # noqa: E731
convert = load_tool("convert_checkpoint").main


def is_norm_weight(name: str) -> bool:
    return name.endswith("norm.weight")


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model.eval()(TOKENS)


@pytest.mark.parametrize("name", list(MODELS))
def test_zero_centred_model_equals_plain_model_with_shifted_weights(name):
    pg = groups_for(1, 0)
    zero = build(ModelConfig(**MODELS[name], apply_layernorm_1p=True), pg, VOCAB)
    plain = build(ModelConfig(**MODELS[name]), pg, VOCAB)
    norms = [p for n, p in zero.named_parameters() if is_norm_weight(n)]
    assert len(norms) == 2 * 2 + 1 and all(not p.any() for p in norms)  # initialized to 0
    assert torch.equal(logits(zero), logits(plain))  # 1 + 0 == 1: the same model at init
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in zero.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
        for (n, p), q in zip(zero.named_parameters(), plain.parameters()):
            q.copy_(p + 1 if is_norm_weight(n) else p)  # the scale the flagged norm applies, rounded alike
    assert torch.equal(logits(zero), logits(plain))
    with torch.no_grad():
        for n, q in plain.named_parameters():
            if is_norm_weight(n):
                q.sub_(1)  # the stored w read as a plain weight: another model
    assert not torch.allclose(logits(zero), logits(plain), atol=1e-2)


def _norm_moved(res: TrainResult, pg: ProcessGroups) -> float:
    """How far the first layer's zero-centred norm weight moved from 0."""
    return res.chunks[0].layers["0"].input_norm.weight.abs().max().item()


def test_tp2_sequence_parallel_matches_serial():
    runs = {name: make_flat(name, True, iters=6, tensor_model_parallel_size=2, sequence_parallel=True)
            for name in MODELS}
    curves = layout_curves(2, runs)
    for name in MODELS:
        ref = serial_curve(make_flat(name, True, iters=6, tensor_model_parallel_size=1, sequence_parallel=False),
                           _norm_moved)
        assert ref.extra > 0, f"{name}: the zero-centred norm weights never moved from 0"
        for rank, r in enumerate(curves):
            assert_rel_close(r[name].losses, ref.losses, 1e-5, f"{name} rank {rank}: loss vs serial")
            assert_rel_close(r[name].grad_norms, ref.grad_norms, 1e-5, f"{name} rank {rank}: grad norm vs serial")


# ---- checkpoints and Hugging Face -----------------------------------------------------------------


def make_flat(name: str, flag: bool, iters: int = 3, **extra) -> dict:
    return dict(MODELS[name], apply_layernorm_1p=flag, micro_batch_size=1, global_batch_size=2, train_iters=iters,
                lr=3e-3, lr_warmup_iters=1, log_interval=5, eval_iters=0, eval_interval=1000, mock_data=True,
                vocab_size=VOCAB, seed=1234, **extra)


def make_cfg(name: str, flag: bool, iters: int = 3, **extra) -> MegaliteConfig:
    return MegaliteConfig.from_flat(make_flat(name, flag, iters, **extra))


def train(cfg: MegaliteConfig):
    validate(cfg, 1)
    return pretrain(cfg, groups_for(1, 0), data=mock_data(VOCAB, SEQ, 1234, 40), log=QUIET)


def load_into(path: str, cfg: MegaliteConfig):
    pg = groups_for(1, 0)
    chunks = build_model(cfg, pg, VOCAB, model_parallel_seed(1, 0, 0))
    load_checkpoint(path, chunks, None, pg, config_dict(cfg.model, VOCAB), load_optim=False, load_rng=False)
    return chunks[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ln1p")
    out = {}
    for name in MODELS:
        path = str(root / name)
        res = train(make_cfg(name, True, save=path))
        out[name] = (path, res.chunks[0])
    return out


def test_checkpoint_stores_w_and_refuses_the_other_setting(saved):
    path, model = saved["llama"]
    reader = CheckpointReader(path)
    assert reader.config["apply_layernorm_1p"] is True
    loaded = load_into(path, make_cfg("llama", True))
    assert torch.equal(loaded.final_norm.weight, model.final_norm.weight)
    assert model.final_norm.weight.abs().max() < 0.5  # w itself, not 1 + w
    with pytest.raises(CheckpointMismatch, match="--apply-layernorm-1p: checkpoint True, flags False"):
        train(make_cfg("llama", False, iters=4, load=path))


def test_checkpoints_from_before_the_flag_mean_plain_weights():
    old = {k: v for k, v in config_dict(ModelConfig(**LLAMA_GQA), VOCAB).items() if k != "apply_layernorm_1p"}
    now = config_dict(ModelConfig(**LLAMA_GQA, apply_layernorm_1p=True), VOCAB)
    assert shape_diffs(old, now) == ["--apply-layernorm-1p: checkpoint False, flags True"]
    assert shape_diffs(old, config_dict(ModelConfig(**LLAMA_GQA), VOCAB)) == []


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_tensors_hold_one_plus_w(name):
    cfg = ModelConfig(**MODELS[name], apply_layernorm_1p=True)
    model = build(cfg, groups_for(1, 0), VOCAB)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    full = dict(model.named_parameters())
    conf, plain = config_dict(cfg, VOCAB), config_dict(ModelConfig(**MODELS[name]), VOCAB)
    hf, hf_plain = to_hf_state_dict(conf, full.__getitem__), to_hf_state_dict(plain, full.__getitem__)
    shifted = {k for k in hf if not torch.equal(hf[k], hf_plain[k])}
    assert len(shifted) == 2 * 2 + 1 and all(k.endswith("norm.weight") or ".ln_" in k for k in shifted)
    assert all(torch.equal(hf[k], hf_plain[k] + 1) for k in shifted)
    back = from_hf_state_dict(conf, hf)
    for k, t in full.items():
        assert torch.equal(back[k] + 1, t + 1) if is_norm_weight(k) else torch.equal(back[k], t), k


@pytest.mark.parametrize("name", list(MODELS))
def test_to_hf_and_back_gives_the_same_logits(saved, tmp_path, name):
    import transformers

    path, model = saved[name]
    want = logits(model)
    hf_dir, back = str(tmp_path / "hf"), str(tmp_path / "back")
    assert convert(["to-hf", "--load", path, "--save", hf_dir]) == 0
    cls = "GPT2LMHeadModel" if name == "gpt2" else "LlamaForCausalLM"
    hf = getattr(transformers, cls).from_pretrained(hf_dir, local_files_only=True).eval()
    with torch.no_grad():
        got = hf(TOKENS).logits
    assert (got - want).abs().max() <= 1e-4 and want.std() > 0.05
    final = hf.transformer.ln_f.weight if name == "gpt2" else hf.model.norm.weight
    assert torch.equal(final, model.final_norm.weight + 1)
    assert convert(["from-hf", "--load", hf_dir, "--save", back, "--apply-layernorm-1p"]) == 0
    assert torch.equal(logits(load_into(back, make_cfg(name, True))), want)
    plain = str(tmp_path / "plain")  # imported without the flag: plain weights, refused by a flagged run
    assert convert(["from-hf", "--load", hf_dir, "--save", plain]) == 0
    with pytest.raises(CheckpointMismatch, match="--apply-layernorm-1p: checkpoint False, flags True"):
        load_into(plain, make_cfg(name, True))
    assert torch.equal(logits(load_into(plain, make_cfg(name, False))), want)
