"""Multi-latent attention flags (Megatron-LM's names: --multi-latent-attention and its sizes), part of the model
section, with the sizes the attention, the cache and the planner derive from them and their rules.

MLA (DeepSeek-V2/V3) replaces the per-head keys and values by one latent vector per token: the input goes down
to --kv-lora-rank channels (normed), which each head's keys (--qk-head-dim) and values (--v-head-dim) are
projected up from; the queries likewise through a --q-lora-rank latent (or directly without one). Position
enters through a separate rotated part of --qk-pos-emb-head-dim channels: each head's own in the query, one
shared by all heads in the key, taken from the input beside the latent. A decoding cache keeps only the latent
and that shared key per token (model/mla.py, inference/kv_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.config.domain import MAX_HIDDEN, Domain, size
from megalite.config.flags import flag_name, option

NON_NEGATIVE = Domain(lo=0)


@dataclass(kw_only=True)
class MLAFields:
    """MLA's options; the sizes act only with --multi-latent-attention."""

    multi_latent_attention: bool = option(
        False, help="Multi-latent attention (DeepSeek-V2/V3): keys and values projected up per head from a shared "
        "latent of --kv-lora-rank channels, with a decoupled RoPE part (--qk-pos-emb-head-dim) shared by the "
        "heads in the key; the decoding cache keeps the latent and that key only. Needs --position-embedding-type "
        "rope or yarn; --kv-channels and --num-query-groups do not apply.")
    q_lora_rank: int | None = option(
        None, help="With --multi-latent-attention: the query latent's size (queries go down to it, through an "
        "RMS/LayerNorm, and up to the heads; DeepSeek-V3: 1536). None or 0: one projection straight to the heads.",
        domain=NON_NEGATIVE)
    kv_lora_rank: int = option(
        32, help="With --multi-latent-attention: the key/value latent's size, what the cache keeps per token "
        "besides the RoPE key (DeepSeek-V3: 512).", domain=size(MAX_HIDDEN))
    qk_head_dim: int = option(
        128, help="With --multi-latent-attention: each head's query/key channels without position "
        "(the q/k head is this plus --qk-pos-emb-head-dim).", domain=size(MAX_HIDDEN))
    qk_pos_emb_head_dim: int = option(
        64, help="With --multi-latent-attention: the rotated query/key channels per head (even); the key's are "
        "shared by all heads.", domain=size(MAX_HIDDEN))
    v_head_dim: int = option(128, help="With --multi-latent-attention: each head's value channels.",
                             domain=size(MAX_HIDDEN))

    @property
    def q_lora(self) -> bool:
        """Whether MLA compresses the queries (--q-lora-rank > 0)."""
        return bool(self.q_lora_rank)

    @property
    def q_head_dim(self) -> int:
        """The channels one query or key head has for the dot product: --qk-head-dim + --qk-pos-emb-head-dim."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    @property
    def rotary_dim(self) -> int:
        """The channels RoPE rotates in each head: MLA's --qk-pos-emb-head-dim, else --rotary-percent of
        --kv-channels (the model's rotary tables are built this wide)."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.kv_channels * self.rotary_percent)  # type: ignore[attr-defined]

    def mla_softmax_scale(self) -> float:
        """MLA's score scale: (--qk-head-dim + --qk-pos-emb-head-dim)^-0.5, times YaRN's mscale(s,
        --mscale-all-dim)^2 (megatron-core's MLA and DeepSeek-V3; ``yarn_softmax_scale_multiplier``)."""
        return self.q_head_dim ** -0.5 * self.yarn_softmax_scale_multiplier  # type: ignore[attr-defined]

    def mla_cache_channels(self) -> int:
        """What MLA's decoding cache keeps per token and layer (on every tensor-parallel rank, in elements): the
        normed latent and the rotated shared key."""
        return self.kv_lora_rank + self.qk_pos_emb_head_dim


MLA_DEFAULTS = {f: MLAFields.__dataclass_fields__[f].default for f in MLAFields.__dataclass_fields__}
SIZES = [f for f in MLA_DEFAULTS if f != "multi_latent_attention"]


def mla_errors(m: MLAFields) -> list[str]:
    """MLA's rules: its sizes only with it; with it, RoPE (the decoupled key needs it), an even rotated part,
    and none of the standard attention's options it has no place for (one line each)."""
    fields = MLAFields.__dataclass_fields__
    if not m.multi_latent_attention:
        given = [flag_name(fields[f]) for f in SIZES if getattr(m, f) != MLA_DEFAULTS[f]]
        return [f"{', '.join(given)} need{'s' if len(given) == 1 else ''} --multi-latent-attention"] if given else []
    errors = []
    if not m.rotary:
        errors.append(f"--multi-latent-attention needs --position-embedding-type rope or yarn (got "
                      f"{m.position_embedding_type}): its decoupled key part is rotated")
    if m.qk_pos_emb_head_dim % 2:
        errors.append(f"--qk-pos-emb-head-dim ({m.qk_pos_emb_head_dim}) must be even: RoPE rotates channel pairs")
    if m.rotary_percent != 1.0:
        errors.append(f"--multi-latent-attention needs --rotary-percent 1 (got {m.rotary_percent:g}): RoPE rotates "
                      "the whole --qk-pos-emb-head-dim part and nothing else")
    refused = [("--group-query-attention", m.group_query_attention, "its keys and values are per head, from the "
                "shared latent (megatron-core refuses it too)"),
               ("--qk-layernorm-scope projection", m.qk_layernorm_scope == "projection", "with it --qk-layernorm "
                "normalizes the query and key latents, whole"),
               ("--window-size", bool(m.window_size) and m.window_size[0] >= 0, "sliding-window attention is not "
                "implemented for it"),
               ("--add-qkv-bias", m.add_qkv_bias, "it has no fused QKV projection (its projections carry no bias)"),
               ("--softmax-scale", m.softmax_scale is not None, "its scale is (--qk-head-dim + "
                "--qk-pos-emb-head-dim)^-0.5 times YaRN's mscale(--rotary-scaling-factor, --mscale-all-dim)^2")]
    errors += [f"--multi-latent-attention and {flag}: {why}" for flag, given, why in refused if given]
    return errors
