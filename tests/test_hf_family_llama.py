"""Promises of the Llama families (Llama 2-style, and Llama 3.1-style: rope_type 'llama3' scaling, trained and
generating past its original context) proven against transformers' LlamaForCausalLM (tests/hf_family.py):
from-hf gives transformers' logits; pretrain_gpt.py --finetune logs the losses of transformers' model + torch
AdamW on the same samples (fp32, within 1e-5); TP2 + SP and PP2 give the serial curve (plain gloo and NCCL's
point-to-point rules); to-hf of the trained checkpoint gives megalite's logits in transformers; generate.py's
greedy tokens equal transformers' generate. Models are built from configs; nothing is downloaded."""

from __future__ import annotations

import pytest

from tests import hf_family as H
from tests.plan_params import assert_planner_counts_hf


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def llama31_config():
    """Llama 3.1's RoPE scaling with an original context of 32: head dim 16 at base 5000 has wavelengths
    below 32 / 4 (kept), between (interpolated) and above 32 (divided by the factor); training runs 48
    tokens and generation reaches 48, past the original context."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 32},
                       rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None)


LLAMA = H.Family("llama", "LlamaForCausalLM", llama_config)
LLAMA31 = H.Family("llama31", "LlamaForCausalLM", llama31_config, seq_length=48)


@pytest.fixture(scope="module", params=[LLAMA, LLAMA31], ids=lambda f: f.name)
def llama(request, tmp_path_factory) -> H.Prepared:
    return H.prepare(request.param, str(tmp_path_factory.mktemp(request.param.name)))


def test_llama31_scaling_comes_in_as_use_rope_scaling(llama):
    if llama.family is not LLAMA31:
        assert "--use-rope-scaling" not in llama.model_flags
        return
    flags = " ".join(llama.model_flags)
    assert ("--use-rope-scaling --rope-scaling-factor 8.0 --rope-scaling-low-freq-factor 1.0 "
            "--rope-scaling-high-freq-factor 4.0 --rope-scaling-original-max-position-embeddings 32") in flags


def test_from_hf_gives_transformers_logits(llama):
    H.assert_imported_logits(llama)


def test_finetune_equals_transformers_and_adamw(llama):
    H.assert_finetune_equals_hf(llama)


@pytest.mark.parametrize("layout, nccl", [("tp2_sp", True), ("pp2", True), ("cp2_p2p", True)])
def test_layouts_give_the_serial_curve(llama, layout, nccl):
    """The Llama 3.1-style family at TP2 + SP, PP2 and CP2 (its scaled RoPE at each rank's zigzag positions)
    under NCCL's point-to-point rules; the plain Llama's layouts are tests/test_hf_conversion.py's."""
    if llama.family is LLAMA:
        pytest.skip("the Llama 3.1-style family covers the layouts; the plain one adds nothing to them")
    H.assert_layout_equals_serial(llama, layout, nccl)


def test_to_hf_of_the_trained_checkpoint_gives_megalites_logits(llama, tmp_path):
    H.assert_exported_logits(llama, str(tmp_path / "out"))


def test_greedy_generation_equals_transformers(llama):
    H.assert_generation_equals_hf(llama)


@pytest.mark.parametrize("flags, expected", [
    (["--use-rope-scaling", "--rope-scaling-factor", "0.5"], "--rope-scaling-factor must be a finite number >= 1"),
    (["--use-rope-scaling", "--rope-scaling-low-freq-factor", "0"],
     "--rope-scaling-low-freq-factor must be a finite number > 0"),
    (["--use-rope-scaling", "--rope-scaling-high-freq-factor", "1"],
     "--rope-scaling-high-freq-factor (1) must exceed --rope-scaling-low-freq-factor (1)"),
    (["--use-rope-scaling"], "--use-rope-scaling needs --position-embedding-type rope"),
])
def test_rope_scaling_flags_out_of_range_are_refused(flags, expected):
    from megalite.config import ConfigError, parse_args, validate

    rope = [] if flags == ["--use-rope-scaling"] else ["--position-embedding-type", "rope"]
    with pytest.raises(ConfigError) as err:
        validate(parse_args(["--mock-data", "--vocab-size", "64", "--train-iters", "1", *rope, *flags]), 1)
    assert expected in str(err.value)


def test_llama3_scaling_keeps_high_scales_low_and_interpolates_between():
    import math

    import torch

    from megalite.model.rope import Llama3Scaling

    s = Llama3Scaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=32)
    wavelen = torch.tensor([6.0, 16.0, 64.0])  # below 32/4, between, above 32
    got = s.apply(2 * math.pi / wavelen) * wavelen / (2 * math.pi)  # scaled / original
    smooth = (32 / 16.0 - 1) / 3
    assert torch.allclose(got, torch.tensor([1.0, (1 - smooth) / 8 + smooth, 1 / 8]))


def test_planner_counts_transformers_parameters(llama):
    assert_planner_counts_hf(llama)
