"""Promise: YaRN RoPE scaling (--position-embedding-type yarn, --rotary-scaling-factor,
--yarn-original-max-position-embeddings, --yarn-beta-fast/--yarn-beta-slow, --mscale, --mscale-all-dim,
--no-yarn-correction-range-round-to-int: Megatron-LM's flags) computes what transformers and megatron-core do.

- cos and sin (the angles of megalite's rope table times its concentration factor) equal transformers'
  rotary embedding of rope_type 'yarn' (_compute_yarn_parameters) for Qwen-style (no mscale), DeepSeek-V3-style
  (mscale = mscale-all-dim) and fractional-ramp configs, past the original context; the softmax-scale
  multiplier multi-latent attention will take equals transformers' yarn_apply_mscale;
- the args to-megatron writes build megatron-core's own YarnRotaryEmbedding with the same angles and
  concentration factor (also where Megatron and transformers differ: --mscale without --mscale-all-dim,
  where megalite follows Megatron); from-megatron reads them back, and the model flags convert_checkpoint
  prints carry them;
- a Llama-style megalite model with YaRN gives the logits of transformers' Llama with the same weights and
  rope parameters (and not those without YaRN);
- each rule of the flags is a one-line error naming them.
"""

from __future__ import annotations

import pytest
import torch

from megalite.checkpointing.megatron.args import config_from_args
from megalite.checkpointing.megatron.export import megatron_args
from megalite.checkpointing.metadata import config_dict, model_config
from megalite.config import ConfigError, parse_args, validate
from megalite.config.model import ModelConfig
from megalite.config.yarn import YARN_DEFAULTS
from megalite.model.gpt import GPTModel
from megalite.model.rope import YarnScaling, rope_frequencies
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.random import RNGTracker

HEAD, BASE, ORIGINAL, POSITIONS = 32, 10000, 512, 2048  # the ramp spans frequencies 1..8 of 16

# name -> megalite's yarn fields; transformers' rope_parameters are made from them below
CASES = {"qwen_style": dict(rotary_scaling_factor=4.0),
         "deepseek_v3_style": dict(rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0),
         "fractional_ramp": dict(rotary_scaling_factor=8.0, yarn_beta_fast=16.0, yarn_beta_slow=2.0, mscale=0.707,
                                 mscale_all_dim=1.0, yarn_correction_range_round_to_int=False)}


def yarn_cfg(**fields) -> ModelConfig:
    return ModelConfig(hidden_size=4 * HEAD, num_attention_heads=4, position_embedding_type="yarn",
                       rotary_base=BASE, yarn_original_max_position_embeddings=ORIGINAL, **fields)


def hf_rope_parameters(cfg: ModelConfig) -> dict:
    out = {"rope_type": "yarn", "rope_theta": float(cfg.rotary_base), "factor": cfg.rotary_scaling_factor,
           "original_max_position_embeddings": cfg.yarn_original_max_position_embeddings,
           "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow,
           "truncate": cfg.yarn_correction_range_round_to_int}
    if cfg.mscale_all_dim:  # transformers reads both only when both are set
        out.update(mscale=cfg.mscale, mscale_all_dim=cfg.mscale_all_dim)
    return out


def megalite_cos_sin(cfg: ModelConfig, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = rope_frequencies(positions, cfg.kv_channels, cfg.rotary_base, scaling=YarnScaling.of(cfg))
    m = cfg.rope_attention_factor
    return angles.cos() * m, angles.sin() * m


@pytest.mark.parametrize("case", list(CASES))
def test_cos_sin_equal_transformers_yarn(case):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import yarn_apply_mscale
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = yarn_cfg(**CASES[case])
    rope = hf_rope_parameters(cfg)
    hf = LlamaRotaryEmbedding(LlamaConfig(hidden_size=4 * HEAD, num_attention_heads=4, rope_parameters=rope,
                                          max_position_embeddings=POSITIONS))
    cos, sin = hf(torch.zeros(1), torch.arange(POSITIONS)[None])
    got_cos, got_sin = megalite_cos_sin(cfg, POSITIONS)
    torch.testing.assert_close(got_cos, cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(got_sin, sin[0], rtol=0, atol=1e-6)
    assert cfg.yarn_softmax_scale_multiplier == pytest.approx(yarn_apply_mscale(rope, 1.0), rel=1e-12)
    plain = rope_frequencies(POSITIONS, HEAD, BASE)
    assert (plain.cos() - got_cos).abs().max() > 0.1  # the scaling moved the frequencies


@pytest.mark.parametrize("case", [*CASES, "mscale_without_mscale_all_dim"])
def test_exported_args_build_megatron_cores_yarn_embedding(case, monkeypatch):
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # its tables move to this device
    cfg = yarn_cfg(**CASES.get(case, dict(rotary_scaling_factor=4.0, mscale=0.8)))
    args = megatron_args(config_dict(cfg, 64), 64)
    assert args.position_embedding_type == "yarn"
    emb = YarnRotaryEmbedding(  # as Megatron-LM's GPT builder maps its arguments (argument_utils.py)
        kv_channels=args.kv_channels, rotary_base=args.rotary_base, use_cpu_initialization=True,
        scaling_factor=args.rotary_scaling_factor,
        original_max_position_embeddings=args.yarn_original_max_position_embeddings,
        beta_fast=args.yarn_beta_fast, beta_slow=args.yarn_beta_slow, mscale=args.mscale,
        mscale_all_dim=args.mscale_all_dim, correction_range_round_to_int=args.yarn_correction_range_round_to_int)
    angles, factor = emb.get_emb(POSITIONS)
    want = rope_frequencies(POSITIONS, HEAD, BASE, scaling=YarnScaling.of(cfg))
    torch.testing.assert_close(angles[:, 0, 0], want, rtol=1e-6, atol=0)
    assert factor == pytest.approx(cfg.rope_attention_factor, rel=1e-12)
    back = model_config(config_from_args(args, 64, "ckpt"))[0]
    assert {k: getattr(back, k) for k in CASES.get(case, {})} == {k: getattr(cfg, k) for k in CASES.get(case, {})}
    assert back.position_embedding_type == "yarn" and back.rope_attention_factor == cfg.rope_attention_factor


def test_megatron_args_without_yarn_values_import_megatrons_defaults():
    args = megatron_args(config_dict(yarn_cfg(rotary_scaling_factor=4.0), 64), 64)
    for name in ("yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
                 "yarn_correction_range_round_to_int"):
        setattr(args, name, None)  # Megatron-LM's argument defaults
    cfg = model_config(config_from_args(args, 64, "ckpt"))[0]
    assert (cfg.yarn_original_max_position_embeddings, cfg.yarn_beta_fast, cfg.yarn_beta_slow,
            cfg.yarn_correction_range_round_to_int) == (4096, 32.0, 1.0, True)


def test_printed_model_flags_carry_yarn():
    """convert_checkpoint prints the flags that train an imported model: YaRN's among them."""
    import shlex

    from tools.convert_checkpoint import model_flags

    cfg = yarn_cfg(**CASES["fractional_ramp"])
    flags = parse_args(["--mock-data", *shlex.split(model_flags(config_dict(cfg, 64)))]).model
    assert {k: getattr(flags, k) for k in YARN_DEFAULTS} == {k: getattr(cfg, k) for k in YARN_DEFAULTS}


def test_llama_with_yarn_gives_transformers_logits():
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from megalite.checkpointing.hf.convert import from_hf_config, from_hf_state_dict
    from tests.test_hf_moe import fill, perturbed

    hf_cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = perturbed(LlamaForCausalLM(hf_cfg))
    tokens = torch.randint(0, 96, (2, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = hf(tokens).logits
    config = from_hf_config(hf_cfg)
    full = from_hf_state_dict(config, hf.state_dict())
    config.update(position_embedding_type="yarn", rotary_scaling_factor=8.0, yarn_original_max_position_embeddings=16)
    cfg, vocab = model_config(config)
    hf.config.rope_parameters = hf_rope_parameters(cfg)
    hf.model.rotary_emb = LlamaRotaryEmbedding(hf.config)
    assert hf.model.rotary_emb.attention_scaling == pytest.approx(cfg.rope_attention_factor) != 1.0
    pg = ProcessGroups.single()
    ours = GPTModel(cfg, BuildContext(pg, RNGTracker()), vocab).eval()
    fill(ours, full, pg)
    with torch.no_grad():
        want, got = hf(tokens).logits, ours(tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (plain - want).abs().max() > 1e-2


BASE_FLAGS = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "64",
              "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1"]


@pytest.mark.parametrize("extra,message", [
    (["--rotary-scaling-factor", "4"], "--rotary-scaling-factor needs --position-embedding-type yarn"),
    (["--position-embedding-type", "rope", "--mscale", "0.5", "--no-yarn-correction-range-round-to-int"],
     "--mscale, --no-yarn-correction-range-round-to-int need --position-embedding-type yarn"),
    (["--position-embedding-type", "yarn", "--rotary-percent", "0.5"],
     "--position-embedding-type yarn needs --rotary-percent 1 (got 0.5)"),
    (["--position-embedding-type", "yarn", "--yarn-beta-fast", "2", "--yarn-beta-slow", "2"],
     "--yarn-beta-fast (2) must exceed --yarn-beta-slow (2)"),
    (["--position-embedding-type", "yarn", "--use-rope-scaling"],
     "--use-rope-scaling needs --position-embedding-type rope"),
    (["--position-embedding-type", "yarn", "--rotary-scaling-factor", "0.5"],
     "--rotary-scaling-factor must be a finite number >= 1, got 0.5"),
])
def test_bad_yarn_flags_are_named(extra, message):
    with pytest.raises(ConfigError) as e:
        validate(parse_args(BASE_FLAGS + extra), 1)
    assert message in str(e.value)
    assert len([line for line in str(e.value).splitlines() if message in line]) == 1



def test_megatrons_rope_type_resolves_into_the_position_embedding():
    """Megatron-LM's --rope-type: unset, multi-latent attention takes YaRN (so its DeepSeek-V3 flags, RoPE with
    --rotary-scaling-factor 40, mean YaRN here too) and standard attention RoPE; given, it picks; a
    disagreement or a learned table is named."""
    from megalite.config import ConfigError, parse_args, validate

    base = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
            "4", "--seq-length", "16", "--micro-batch-size", "1", "--position-embedding-type", "rope"]
    mla = ["--multi-latent-attention", "--rotary-scaling-factor", "4", "--mscale-all-dim", "1.0"]
    for extra, kind in ((mla, "yarn"), (["--multi-latent-attention", "--rope-type", "rope"], "rope"),
                        (["--rope-type", "yarn", "--rotary-scaling-factor", "4"], "yarn"), ([], "rope")):
        cfg = parse_args(base + extra)
        validate(cfg, 1)
        assert cfg.model.position_embedding_type == kind, extra
    for extra, message in ((["--position-embedding-type", "learned_absolute", "--rope-type", "yarn"],
                            "--rope-type yarn needs --position-embedding-type rope"),
                           (["--position-embedding-type", "yarn", "--rope-type", "rope"],
                            "--rope-type rope and --position-embedding-type yarn disagree")):
        with pytest.raises(ConfigError, match=message):
            validate(parse_args(base + extra), 1)
