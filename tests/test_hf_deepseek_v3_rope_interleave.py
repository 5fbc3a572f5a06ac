"""DeepSeek-V3 with rope_interleave false (transformers' rotate-half RoPE on q_pe and the shared k_pe): from-hf
reorders the RoPE rows of the query up-projection and kv_a_proj_with_mqa into the pairs megalite's MLA rotates,
so the import gives transformers' logits; to-hf writes rope_interleave true (the form megalite holds) and gives
them again. Tiny models (2 layers), every weight perturbed, one process."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megalite.checkpointing.hf.families.deepseek_v3 import ADAPTER, halves_to_pairs
from megalite.model.mla import mla_rope
from tests import hf_family as H
from tests.test_hf_family_deepseek_v3 import YARN, deepseek_v3_config

# query compression + YaRN, and q_proj + plain RoPE; qk_rope_head_dim 8: four pairs, so the reordering is no swap
SMALL = dict(num_hidden_layers=2, first_k_dense_replace=1, qk_rope_head_dim=8, rope_interleave=False)
FAMILIES = {
    "q_lora_yarn": H.Family("deepseek_v3_halves", "DeepseekV3ForCausalLM", lambda: deepseek_v3_config(
        **SMALL, rope_parameters=dict(YARN))),
    "q_proj_rope": H.Family("deepseek_v3_halves_plain", "DeepseekV3ForCausalLM", lambda: deepseek_v3_config(
        **SMALL, q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})),
}


def test_reordered_rows_rotate_into_transformers_q_pe():
    """The claim the import rests on: megalite's pair rotation of the reordered channels is transformers'
    rotate-half rotation of the stored ones, channel for channel (not only in q.k)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb

    d, s = 8, 5
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(s, dtype=torch.float64)[:, None] * torch.cat([inv, inv])  # [s, d]
    x = torch.randn(2, 3, s, d, dtype=torch.float64)  # [b, heads, s, d]
    want, _ = apply_rotary_pos_emb(x, x, angles.cos()[None], angles.sin()[None])
    w = torch.eye(d, dtype=torch.float64)  # the rows of an identity projection are the channels
    order = halves_to_pairs(w, d, d).argmax(dim=1)
    got = mla_rope(x[..., order].permute(2, 0, 1, 3), angles).permute(1, 2, 0, 3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_stored_weights_reorders_every_layers_rope_rows_only():
    """Each head's RoPE rows of q_b_proj and kv_a_proj_with_mqa's last rows, in every layer index (an MTP depth's,
    past num_hidden_layers, too); nothing else, and nothing at all with rope_interleave true."""
    c = deepseek_v3_config(**SMALL)
    heads, nope, rope, rank = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
    order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])
    sd = {f"model.layers.{i}.self_attn.{n}.weight": torch.randn(rows, 5) for i in range(3)
          for n, rows in (("q_b_proj", heads * (nope + rope)), ("kv_a_proj_with_mqa", rank + rope),
                          ("o_proj", heads * 6))}
    out = ADAPTER.stored_weights(c, sd)
    for i in range(3):
        q, q0 = (t[f"model.layers.{i}.self_attn.q_b_proj.weight"].view(heads, nope + rope, 5) for t in (out, sd))
        assert torch.equal(q[:, :nope], q0[:, :nope]) and torch.equal(q[:, nope:], q0[:, nope:][:, order])
        kv, kv0 = (t[f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"] for t in (out, sd))
        assert torch.equal(kv[:rank], kv0[:rank]) and torch.equal(kv[rank:], kv0[rank:][order])
        assert out[f"model.layers.{i}.self_attn.o_proj.weight"] is sd[f"model.layers.{i}.self_attn.o_proj.weight"]
    assert ADAPTER.stored_weights(deepseek_v3_config(), sd) is sd


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_rope_interleave_false_imports_and_exports_exactly(kind, tmp_path):
    family = FAMILIES[kind]
    p = H.prepare(family, str(tmp_path))
    assert p.hf_model.config.rope_interleave is False
    H.assert_imported_logits(p)
    out = str(tmp_path / "out")
    assert H.convert(["to-hf", "--load", p.imported, "--save", out]) == 0
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["rope_interleave"] is True
    tokens = H.sample_tokens(family, seed=11)
    with torch.no_grad():
        want = p.hf_model(input_ids=tokens).logits
    H.assert_close_logits(H.hf_logits(out, family.hf_class, tokens), want, f"{kind}: to-hf of the import")
