"""Promise (model/mla.py, docs/models.md): --multi-latent-attention with Megatron-LM's sizes computes what
transformers' DeepseekV3Attention computes, in every layout, and decodes from a latent cache.

- one MLA layer with the same weights gives transformers' DeepseekV3Attention output and every gradient
  (input and each weight, to 2e-5 on O(1) values): without query compression and a value head wider than
  the query/key head (q and k padded for the core), with query compression under YaRN (softmax scale times
  mscale^2; the RoPE part read as interleaved pairs), and the latter again on the 'unfused' backend with
  selective recomputation;
- 4 iterations of a 2-layer MLA model on packed documents give the serial loss curve and grad norms (fp32,
  relative 1e-5) at TP2 with SP (replicated down-projections on the sequence shard), CP2 p2p, CP2 a2a with
  selective recomputation and PP2 with full recomputation, under NCCL's point-to-point rules; bf16 and fp16
  runs follow the fp32 curve;
- greedy generation with the cache equals generation recomputing the whole sequence, the cached steps' logits
  equal the full pass's, and the cache holds (--kv-lora-rank + --qk-pos-emb-head-dim) elements per token and
  layer, not per-head keys and values;
- the planner counts the built model's parameters and FLOPs of its GEMMs; the KV-cache bytes it states are the
  cache's;
- each inconsistent flag combination is a one-line error naming the flags.
"""

from __future__ import annotations

import pytest
import torch

from megalite.config import ConfigError, parse_args, validate
from megalite.config.model import ModelConfig
from megalite.model.gpt import GPTModel
from megalite.model.mla import MultiLatentAttention
from megalite.model.rope import rope_frequencies, rope_scaling
from megalite.parallel.groups import ProcessGroups
from megalite.planning.mla import kv_cache_bytes_per_token
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.random import RNGTracker
from tests.layouts import LayoutMatrix, serial_curve
from tests.tp_utils import build, layout_flat

SHAPE = dict(hidden_size=32, num_attention_heads=4, multi_latent_attention=True, qk_layernorm=True, kv_lora_rank=12,
             qk_head_dim=8,
             qk_pos_emb_head_dim=4, v_head_dim=6, normalization="RMSNorm", norm_epsilon=1e-6,
             disable_bias_linear=True, attention_dropout=0.0, hidden_dropout=0.0)
YARN = dict(position_embedding_type="yarn", rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0,
            yarn_original_max_position_embeddings=8)
MLA_SIZES = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
             "v_head_dim")
LAYER_CASES = {
    "no_q_lora_wide_v": dict(position_embedding_type="rope", v_head_dim=16),
    "q_lora_yarn": dict(q_lora_rank=6, **YARN),
    "q_lora_yarn_unfused_selective": dict(q_lora_rank=6, attention_backend="unfused",
                                          recompute_granularity="selective", **YARN),
}


def hf_attention(cfg: ModelConfig):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": float(cfg.rotary_base)}
    if cfg.position_embedding_type == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": float(cfg.rotary_base), "factor": cfg.rotary_scaling_factor,
                "original_max_position_embeddings": cfg.yarn_original_max_position_embeddings,
                "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow, "mscale": cfg.mscale,
                "mscale_all_dim": cfg.mscale_all_dim}
    hc = DeepseekV3Config(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                          num_key_value_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank or None,
                          kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_head_dim,
                          qk_rope_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim, rope_parameters=rope,
                          attention_bias=False, rope_interleave=True, rms_norm_eps=cfg.norm_epsilon,
                          max_position_embeddings=cfg.yarn_original_max_position_embeddings * 4)
    hc._attn_implementation = "eager"
    return DeepseekV3Attention(hc, 0), DeepseekV3RotaryEmbedding(hc)


# megalite's MLA parameter -> transformers' DeepseekV3Attention parameter (the adapter's renames)
HF_NAMES = {"q_proj": "q_proj", "q_down_proj": "q_a_proj", "q_layernorm": "q_a_layernorm", "q_up_proj": "q_b_proj",
            "kv_down_proj": "kv_a_proj_with_mqa", "kv_layernorm": "kv_a_layernorm", "kv_up_proj": "kv_b_proj",
            "proj": "o_proj"}


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_equals_transformers_deepseek_v3_attention(case):
    torch.manual_seed(0)
    cfg = ModelConfig(**{**SHAPE, **LAYER_CASES[case]})
    ours = MultiLatentAttention(cfg, BuildContext(ProcessGroups.single(), RNGTracker()))
    for p in ours.parameters():  # O(1) weights, norms away from 1: every term of the layer matters
        torch.nn.init.normal_(p, 0, 0.3) if p.dim() == 2 else torch.nn.init.uniform_(p, 0.5, 1.5)
    hf, rotary = hf_attention(cfg)
    params = {HF_NAMES[n.split(".")[0]] + ".weight": p for n, p in ours.named_parameters()}
    hf.load_state_dict({k: p.detach().clone() for k, p in params.items()})  # strict: every weight mapped
    s, b = 10, 2
    x = torch.randn(s, b, cfg.hidden_size, requires_grad=True)
    out = ours(x, rope_frequencies(s, cfg.rotary_dim, cfg.rotary_base, scaling=rope_scaling(cfg)))
    xh = x.detach().transpose(0, 1).clone().requires_grad_(True)
    cos_sin = rotary(xh, torch.arange(s)[None].expand(b, -1))
    want, _ = hf(xh, cos_sin, torch.full((s, s), float("-inf")).triu(1)[None, None])
    torch.testing.assert_close(out.transpose(0, 1), want, rtol=0, atol=2e-5)
    grad = torch.randn_like(want)
    want.backward(grad)
    out.backward(grad.transpose(0, 1))
    torch.testing.assert_close(x.grad.transpose(0, 1), xh.grad, rtol=0, atol=2e-5)
    theirs = dict(hf.named_parameters())
    for name, p in params.items():
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=0, atol=2e-5, msg=name)


# ---- every layout: the serial curve ------------------------------------------------------------------
VOCAB, ITERS = 64, 4
PACKED = {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True}
MODEL = {**SHAPE, "num_layers": 2, "seq_length": 16, "q_lora_rank": 6, **YARN, "swiglu": True,
         "untie_embeddings_and_output_weights": True, **PACKED}
LAYOUTS = {"tp2_sp": (2, 1, 1, {"sequence_parallel": True}),
           "cp2_p2p": (1, 1, 2, {}),
           "cp2_a2a_selective": (1, 1, 2, {"cp_comm_type": "a2a", "recompute_granularity": "selective"}),
           "pp2_full_recompute": (1, 2, 1, {"recompute_granularity": "full", "recompute_method": "uniform",
                                            "recompute_num_layers": 1})}


def flat(model: str, tp: int = 1, pp: int = 1, cp: int = 1, **extra) -> dict:
    return layout_flat(MODEL, vocab=VOCAB, iters=ITERS, tp=tp, pp=pp, context_parallel_size=cp, **extra)


MATRIX = LayoutMatrix(2, flat, LAYOUTS, [("mla", n) for n in LAYOUTS], [])


@pytest.mark.parametrize("mode,model,layout", MATRIX.params())
def test_mla_layouts_give_the_serial_curve(mode, model, layout):
    MATRIX.check(mode, model, layout, ITERS)


def _gradients(rank: int, world: int) -> dict[bool, dict[str, torch.Tensor]]:
    """Per --sequence-parallel, every parameter's final gradient (gathered over TP) of one loss."""
    from megalite.distributed.finalize import finalize_grads
    from megalite.distributed.grad_buffer import GradBuffer
    from megalite.tensor_parallel.init import initialize_parameters
    from megalite.tensor_parallel.random import model_parallel_seed
    from tests.tp_utils import gather_full, groups_for

    cfg = ModelConfig(**{k: v for k, v in MODEL.items() if k not in PACKED})
    pg = groups_for(world, rank, tp=world)
    out = {}
    for sp in ((False, True) if world > 1 else (False,)):
        ctx = BuildContext(pg, model_parallel_seed(1234, pg.tp_rank, pg.pp_rank), sequence_parallel=sp)
        model = GPTModel(cfg, ctx, VOCAB)
        initialize_parameters(model, pg, 1234, 0.3, cfg.num_layers)
        buffers = [GradBuffer(list(model.parameters()), pg, grad_dtype=torch.float32, bucket_size=5000)]
        tokens = torch.randint(0, VOCAB, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(7))
        model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
        finalize_grads([model], buffers, pg)
        out[sp] = {n: gather_full(p, p.main_grad, pg) for n, p in model.named_parameters()}
        out["numel"] = sum(p.numel() for p in model.parameters())
    return out


@pytest.fixture(scope="module")
def tp2_runs() -> list[dict]:
    from tests.harness import run_ranks

    return run_ranks(_gradients, 2)


def test_tp2_gradients_equal_serial_with_and_without_sequence_parallelism(tp2_runs):
    """Each rank's heads read the shared latent and RoPE key: their gradients must sum over TP (with SP: the
    replicated down-projections' partial sums too). The curves above barely see a wrong sum under Adam."""
    ref = _gradients(0, 1)[False]
    for rank, run in enumerate(tp2_runs):
        for sp, grads in ((sp, g) for sp, g in run.items() if sp != "numel"):
            for name, want in ref.items():
                torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-6, msg=f"rank {rank} sp {sp} {name}")


def _save_at_tp2_sp(rank: int, world: int, folder: str) -> list[float]:
    from megalite.config.arguments import MegaliteConfig
    from megalite.launch.run import build_groups
    from tests.layouts import train

    run = flat("mla", 2, 1, 1, sequence_parallel=True, exit_interval=2, save=folder)
    return train(run, build_groups(MegaliteConfig.from_flat(run), world, rank), world).losses


def test_checkpoint_saved_at_tp2_sp_resumes_serially_on_the_curve(tmp_path):
    """The replicated down-projections and norms are saved once and the heads' shards joined: a TP2+SP run
    stopped after 2 iterations resumes in one process on the serial curve."""
    from megalite.parallel.groups import ProcessGroups
    from tests.harness import run_ranks
    from tests.layouts import train

    folder = str(tmp_path / "ckpt")
    ref = serial_curve(flat("mla")).losses
    assert run_ranks(_save_at_tp2_sp, 2, folder)[0] == pytest.approx(ref[:2], rel=1e-5)
    resumed = train({**flat("mla"), "load": folder}, ProcessGroups.single(), 1).losses
    assert resumed == pytest.approx(ref[2:], rel=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_follows_the_fp32_curve(precision):
    ref = serial_curve(flat("mla")).losses
    got = serial_curve({**flat("mla"), precision: True}).losses
    assert all(abs(a - b) < 0.02 * abs(b) for a, b in zip(got, ref)), (got, ref)


# ---- decoding from the latent cache -----------------------------------------------------------------
def small_model(**extra):
    cfg = ModelConfig(**{**SHAPE, "num_layers": 2, "seq_length": 32, "q_lora_rank": 6, **YARN, "swiglu": True,
                         "untie_embeddings_and_output_weights": True, "init_method_std": 0.3, **extra})
    return cfg, build(cfg, ProcessGroups.single(), VOCAB)


def test_greedy_generation_from_the_latent_cache_equals_recomputation():
    from megalite.inference.generation import generate
    from megalite.inference.kv_cache import KVCache

    cfg, model = small_model()
    pg = ProcessGroups.single()
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    cached = generate([model], pg, prompts, 6, use_cache=True)
    assert cached.tokens == generate([model], pg, prompts, 6, use_cache=False).tokens
    assert len(set(cached.new_tokens[0])) > 2  # the model is not stuck on one token
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    cache = KVCache(9)
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, :5], kv_cache=cache)]
        cache.advance(5)
        for t in range(5, 9):
            steps.append(model(tokens[:, t:t + 1], kv_cache=cache))
            cache.advance(1)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=2e-5)
    per_token = cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim) * 4  # fp32 latent + RoPE key
    assert cache.nbytes == 2 * 9 * per_token == 2 * 9 * kv_cache_bytes_per_token(cfg, element_bytes=4)
    standard_cfg = ModelConfig(**{k: v for k, v in MODEL.items() if k not in (*PACKED, *MLA_SIZES)},
                               group_query_attention=True, num_query_groups=2)
    standard = build(standard_cfg, pg, VOCAB)
    cache = KVCache(9)
    with torch.no_grad():
        standard(tokens, kv_cache=cache)
    assert cache.nbytes == 2 * 9 * kv_cache_bytes_per_token(standard_cfg, element_bytes=4) == 2 * 9 * 2 * 2 * 2 * 8 * 4


# ---- flags --------------------------------------------------------------------------------------------
BASE_FLAGS = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "64",
              "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1"]
MLA_FLAGS = ["--multi-latent-attention", "--position-embedding-type", "rope"]


@pytest.mark.parametrize("extra,message", [
    (["--kv-lora-rank", "16", "--q-lora-rank", "8"], "--q-lora-rank, --kv-lora-rank need --multi-latent-attention"),
    (["--multi-latent-attention"], "--multi-latent-attention needs --position-embedding-type rope or yarn"),
    (MLA_FLAGS + ["--qk-pos-emb-head-dim", "7"], "--qk-pos-emb-head-dim (7) must be even"),
    (MLA_FLAGS + ["--rotary-percent", "0.5"], "--multi-latent-attention needs --rotary-percent 1"),
    (MLA_FLAGS + ["--group-query-attention", "--num-query-groups", "2"],
     "--multi-latent-attention and --group-query-attention"),
    (MLA_FLAGS + ["--qk-layernorm", "--qk-layernorm-scope", "projection", "--normalization", "RMSNorm"],
     "--multi-latent-attention and --qk-layernorm-scope projection"),
    (MLA_FLAGS + ["--window-size", "4", "0"], "--multi-latent-attention and --window-size"),
    (MLA_FLAGS + ["--add-qkv-bias"], "--multi-latent-attention and --add-qkv-bias"),
    (MLA_FLAGS + ["--softmax-scale", "0.1"], "--multi-latent-attention and --softmax-scale"),
    (MLA_FLAGS + ["--kv-lora-rank", "0"], "--kv-lora-rank must be"),
])
def test_bad_mla_flags_are_named(extra, message):
    with pytest.raises(ConfigError) as e:
        validate(parse_args(BASE_FLAGS + extra), 1)
    assert len([line for line in str(e.value).splitlines() if message in line]) == 1, str(e.value)


def test_mla_flags_parse_with_megatrons_defaults():
    m = parse_args(BASE_FLAGS + MLA_FLAGS + ["--q-lora-rank", "0"]).model
    validate(parse_args(BASE_FLAGS + MLA_FLAGS + ["--q-lora-rank", "0"]), 1)
    assert (m.q_lora, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim) == (False, 32, 128, 64, 128)


# ---- checkpoints: compared on load, refused by the exports not written yet -----------------------------
def test_checkpoints_compare_mla_fields_and_other_families_refuse_mla():
    """MLA fields are shape fields (older checkpoints: off); a family without MLA refuses it by name on to-hf
    (to-megatron writes it: tests/test_megatron_mla.py)."""
    from megalite.checkpointing.hf.common import HFConversionError
    from megalite.checkpointing.hf.convert import to_hf_config
    from megalite.checkpointing.load import shape_diffs
    from megalite.checkpointing.metadata import config_dict

    cfg, _ = small_model()
    saved = config_dict(cfg, VOCAB)
    standard = {k: v for k, v in saved.items() if k not in ("multi_latent_attention", "q_lora_rank")}
    assert any("--multi-latent-attention" in d for d in shape_diffs(standard, saved))  # an older checkpoint: off
    assert any("--kv-lora-rank" in d for d in shape_diffs(saved, {**saved, "kv_lora_rank": 16}))
    with pytest.raises(HFConversionError, match="missing: no --multi-latent-attention"):
        to_hf_config({**saved, "position_embedding_type": "rope", "rope_type": "rope"})


# ---- the planner ---------------------------------------------------------------------------------------
def test_planner_counts_the_built_models_parameters_flops_and_saved_bytes(tp2_runs):
    """Parameters per rank at TP1 and TP2 (replicated down-projections, heads split) as built; the projections'
    multiply-adds are their weights' sizes; one layer's saved bytes as autograd measures them (bf16, unfused
    core, with and without selective recomputation: exact on the torch releases the RMSNorm term holds)."""
    from megalite.planning import mla
    from megalite.planning.memory import chunk_activation_bytes, stage_params
    from megalite.planning.shape import RunShape
    from tests.plan_measure import layer_activation_bytes, rms_norm_overcount
    from tests.test_planning import planner_cfg

    model = {k: v for k, v in MODEL.items() if k not in PACKED}
    cfg, built = small_model()
    numel_1 = sum(p.numel() for p in built.parameters())
    for tp, numel in ((1, sum(p.numel() for p in built.parameters())), (2, tp2_runs[0]["numel"])):
        sh = RunShape.of(planner_cfg(model, tp, tensor_model_parallel_size=tp), tp, VOCAB)
        assert stage_params(sh, 0) == numel, tp
    # without --qk-layernorm MLA has no latent norms (megatron-core's rule): neither built nor counted
    _, bare = small_model(qk_layernorm=False)
    assert not [n for n, _ in bare.named_parameters() if "latent" in n or "q_layernorm" in n or "kv_layernorm" in n]
    sh = RunShape.of(planner_cfg({**model, "qk_layernorm": False}, 1), 1, VOCAB)
    assert stage_params(sh, 0) == sum(p.numel() for p in bare.parameters()) == numel_1 - 6 * 2 - 12 * 2
    attention = built.layers["0"].attention
    weights = sum(p.numel() for n, p in attention.named_parameters() if p.dim() == 2)
    assert mla.gemm_macs(cfg) == weights
    assert mla.core_macs(cfg, 16) == 16 * 4 * ((8 + 4) + 6)
    shape = {**model, "seq_length": 48, "attention_backend": "unfused"}
    for gran in (None, "selective"):
        measured = layer_activation_bytes(ModelConfig(**{**shape, "num_layers": 1, "recompute_granularity": gran}),
                                          ProcessGroups.single(), 3, VOCAB)
        sh = RunShape.of(planner_cfg(shape, 1, num_layers=1, bf16=True, micro_batch_size=3,
                                     recompute_granularity=gran), 1, VOCAB)
        assert chunk_activation_bytes(sh) - rms_norm_overcount(sh) == pytest.approx(measured, rel=0.05), gran
