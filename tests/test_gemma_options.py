"""The general options Gemma's block is made of, where the family tests (tests/test_hf_family_gemma2.py,
test_hf_family_gemma3.py: logits, training at every layout and generation against transformers) do not
reach:

- --final-logit-softcapping C: the vocab-parallel and the fused cross-entropy cap the logits to
  C * tanh(logits / C) and take the cap's derivative into their gradients (the unfused one reading the
  capped logits back from its saved exp, the fused one per chunk, also where backward recomputes a chunk),
  equal to autograd through torch's own cap and cross-entropy; the padded vocabulary columns stay out;
- the flag rules (--geglu, --rotary-base-local, --rotary-seq-len-interpolation-factor), each one line;
- to-megatron refuses by name what Megatron-LM's arguments cannot express."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.tensor_parallel.fused_cross_entropy import fused_linear_cross_entropy

VOCAB, CAP = 100, 2.0


def _upstream(shape: torch.Size) -> dict[str, torch.Tensor]:
    n = shape.numel()
    mask = (torch.arange(n) % 5 != 2).float()
    return {"mean": torch.full(shape, 1.0 / n), "masked": (mask / mask.sum()).view(shape),
            "weighted": torch.linspace(-1.0, 2.0, n).view(shape) / n}


def _reference(x, w, target, grad_out):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    logits = F.linear(x, w)[..., :VOCAB]
    capped = torch.tanh(logits / CAP) * CAP
    loss = F.cross_entropy(capped.reshape(-1, VOCAB), target.reshape(-1), reduction="none").view(target.shape)
    (loss * grad_out).sum().backward()
    return loss.detach(), x.grad, w.grad


def _ours(x, w, target, grad_out, fused: bool, rows: int):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    pg = ProcessGroups.single()
    loss = (fused_linear_cross_entropy(x, w, target, pg, VOCAB, rows=rows, softcap=CAP) if fused
            else vocab_parallel_cross_entropy(F.linear(x, w), target, pg, VOCAB, softcap=CAP))
    (loss * grad_out).sum().backward()
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("fused, rows", [(False, 0), (True, 4), (True, 1000)])
def test_capped_loss_and_gradients_equal_autograd(fused, rows):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 3, 16, generator=gen), torch.randn(128, 16, generator=gen)  # logits far past the cap
    target = torch.randint(0, VOCAB, (7, 3), generator=gen)
    for kind, grad_out in _upstream(target.shape).items():
        want = _reference(x, w, target, grad_out)
        got = _ours(x, w, target, grad_out, fused, rows)
        for name, a, b in zip(("loss", "grad x", "grad w"), got, want):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (kind, name, (a - b).abs().max().item())
    uncapped = vocab_parallel_cross_entropy(F.linear(x, w), target, ProcessGroups.single(), VOCAB)
    assert (uncapped - want[0]).abs().max() > 1.0  # the cap changes the loss: the check above means something


@pytest.mark.parametrize("change, named", [
    ({"geglu": True}, "--geglu is not exported"),
    ({"embedding_multiplier": 5.0}, "--embedding-multiplier is not exported"),
    ({"final_logit_softcapping": 30.0}, "--final-logit-softcapping is not exported"),
    ({"rotary_base_local": 10000}, "--rotary-base-local is not exported"),
    ({"rotary_seq_len_interpolation_factor": 2.5}, "--rotary-seq-len-interpolation-factor 2.5 is not exported")])
def test_what_megatron_lm_cannot_express_is_refused_by_name(change, named):
    from megalite.checkpointing.errors import CheckpointError
    from megalite.checkpointing.megatron.export import _refuse_unexported

    _refuse_unexported({"rotary_seq_len_interpolation_factor": 8.0, "softmax_scale": 0.25})  # both exported
    with pytest.raises(CheckpointError, match=f"to-megatron: {named}"):
        _refuse_unexported(change)


@pytest.mark.parametrize("flags, named", [
    (["--swiglu", "--geglu"], "--swiglu and --geglu are two activations of the gated MLP: pick one"),
    (["--position-embedding-type", "rope", "--rotary-base-local", "10000"],
     "--rotary-base-local needs --position-embedding-type rope and windowed layers"),
    (["--rotary-seq-len-interpolation-factor", "4"], "--rotary-seq-len-interpolation-factor needs "
     "--position-embedding-type rope"),
    (["--position-embedding-type", "rope", "--use-rope-scaling", "--rotary-seq-len-interpolation-factor", "4"],
     "--rotary-seq-len-interpolation-factor and --use-rope-scaling are two RoPE scalings: pick one"),
    (["--rotary-seq-len-interpolation-factor", "0.5"], "--rotary-seq-len-interpolation-factor must be a finite "
     "number >= 1"),
    (["--embedding-multiplier", "0"], "--embedding-multiplier must be a finite number > 0"),
    (["--softmax-scale", "nan"], "--softmax-scale must be a finite number > 0"),
    (["--final-logit-softcapping", "-3"], "--final-logit-softcapping must be a finite number > 0")])
def test_flag_rules_are_named(flags, named):
    from megalite.config import validate
    from megalite.config.arguments import parse_args
    from megalite.config.validate import ConfigError

    with pytest.raises(ConfigError, match=named):
        validate(parse_args(flags), 1)


def test_planner_counts_geglu_as_swiglu_and_the_final_cap_per_logit():
    from megalite.config.model import ModelConfig
    from megalite.planning.flops import flops_per_token

    base = dict(hidden_size=64, num_attention_heads=4, position_embedding_type="rope", normalization="RMSNorm")
    swiglu, geglu = ModelConfig(**base, swiglu=True), ModelConfig(**base, geglu=True)
    assert geglu.ffn_hidden_size == swiglu.ffn_hidden_size
    assert flops_per_token(geglu, 1000, 128) == flops_per_token(swiglu, 1000, 128)
    capped = ModelConfig(**base, geglu=True, final_logit_softcapping=30.0)
    assert flops_per_token(capped, 1000, 128) - flops_per_token(geglu, 1000, 128) == 3 * 1000
