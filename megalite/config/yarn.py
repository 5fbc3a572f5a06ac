"""YaRN RoPE scaling flags (Megatron-LM's names: --position-embedding-type yarn and its options), part of the
model section, with the two scalars they give the attention (the frequencies: model/rope.py) and their rules.

YaRN (Peng et al. 2023) stretches a RoPE model's context by --rotary-scaling-factor s: each frequency is
blended between its interpolated value (divided by s) and its original one by a linear ramp between the
correction dimensions where a frequency turns --yarn-beta-fast and --yarn-beta-slow times over the original
context; cos and sin are multiplied by the concentration factor mscale(s, --mscale) / mscale(s,
--mscale-all-dim), mscale(s, m) = 0.1 m ln s + 1 (1 for s <= 1), as megatron-core's YarnRotaryEmbedding and
transformers' 'yarn' rope type compute them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megalite.config.domain import Domain, at_least, positive, size
from megalite.config.flags import flag_name, option

NON_NEGATIVE = Domain(lo=0)


@dataclass(kw_only=True)
class YarnFields:
    """YaRN's options; they act only with --position-embedding-type yarn."""

    rotary_scaling_factor: float = option(
        1.0, help="With --position-embedding-type yarn: s, how many times the original context the model is "
        "stretched to (DeepSeek-V3: 40); the frequencies below the ramp are divided by it.", domain=at_least(1.0))
    yarn_original_max_position_embeddings: int = option(
        4096, help="With --position-embedding-type yarn: the context the model was first trained at, where the "
        "correction dimensions are found (megatron-core's default 4096).", domain=size())
    yarn_beta_fast: float = option(
        32.0, help="With --position-embedding-type yarn: frequencies turning more than this many times over the "
        "original context are kept (extrapolated).", domain=positive())
    yarn_beta_slow: float = option(
        1.0, help="With --position-embedding-type yarn: frequencies turning fewer than this many times over the "
        "original context are divided by --rotary-scaling-factor (interpolated); a linear ramp between.",
        domain=positive())
    mscale: float = option(
        1.0, help="With --position-embedding-type yarn: m in the concentration factor mscale(s, m) / mscale(s, "
        "--mscale-all-dim) that multiplies cos and sin, mscale(s, m) = 0.1 m ln s + 1.", domain=NON_NEGATIVE)
    mscale_all_dim: float = option(
        0.0, help="With --position-embedding-type yarn: the denominator's m of the concentration factor; "
        "multi-latent attention also multiplies its softmax scale by mscale(s, this)^2 (DeepSeek-V3: 1).",
        domain=NON_NEGATIVE)
    yarn_correction_range_round_to_int: bool = option(
        True, flag="--no-yarn-correction-range-round-to-int",
        help="With --position-embedding-type yarn: keep the correction dimensions fractional instead of rounding "
        "them outward to integers (transformers' truncate: false).")

    @property
    def rotary(self) -> bool:
        """Whether the attention rotates q and k (plain RoPE or YaRN)."""
        return self.position_embedding_type in ("rope", "yarn")  # type: ignore[attr-defined]

    @property
    def rope_attention_factor(self) -> float:
        """What cos and sin are multiplied by: YaRN's concentration factor, else 1."""
        if self.position_embedding_type != "yarn":  # type: ignore[attr-defined]
            return 1.0
        return yarn_mscale(self.rotary_scaling_factor, self.mscale) / yarn_mscale(self.rotary_scaling_factor,
                                                                                   self.mscale_all_dim)

    @property
    def yarn_softmax_scale_multiplier(self) -> float:
        """mscale(s, --mscale-all-dim)^2: what multi-latent attention multiplies its softmax scale by under YaRN
        (megatron-core's MLA and DeepSeek-V3); standard attention does not use it. 1 without YaRN."""
        if self.position_embedding_type != "yarn":  # type: ignore[attr-defined]
            return 1.0
        return yarn_mscale(self.rotary_scaling_factor, self.mscale_all_dim) ** 2


def yarn_mscale(scale: float, m: float) -> float:
    """YaRN's mscale(s, m) = 0.1 m ln s + 1, 1 for s <= 1."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


YARN_DEFAULTS = {f: YarnFields.__dataclass_fields__[f].default for f in YarnFields.__dataclass_fields__}


def yarn_errors(m: YarnFields) -> list[str]:
    """YaRN's rules: its options only with it, the whole head rotated, the ramp the right way round (an even
    head and --use-rope-scaling with it: config/validate.py's rules)."""
    rope_type = getattr(m, "rope_type", None)
    if rope_type is not None and m.position_embedding_type == "learned_absolute":
        return [f"--rope-type {rope_type} needs --position-embedding-type rope (it picks the kind of RoPE)"]
    if rope_type == "rope" and m.position_embedding_type == "yarn":
        return ["--rope-type rope and --position-embedding-type yarn disagree (plain RoPE or YaRN: give one)"]
    if m.position_embedding_type != "yarn":
        fields = YarnFields.__dataclass_fields__
        given = [flag_name(fields[f]) for f, d in YARN_DEFAULTS.items() if getattr(m, f) != d]
        return [f"{', '.join(given)} need{'s' if len(given) == 1 else ''} --position-embedding-type yarn"] \
            if given else []
    errors = []
    if m.rotary_percent != 1.0:
        errors.append(f"--position-embedding-type yarn needs --rotary-percent 1 (got {m.rotary_percent:g}): "
                      "megatron-core's YaRN frequencies span the whole head")
    if m.yarn_beta_fast <= m.yarn_beta_slow:
        errors.append(f"--yarn-beta-fast ({m.yarn_beta_fast:g}) must exceed --yarn-beta-slow ({m.yarn_beta_slow:g})")
    return errors


def yarn_flags(config: dict) -> list[str]:
    """The command-line flags of a model config dict's YaRN options that differ from their defaults."""
    out: list[str] = []
    for f, default in YARN_DEFAULTS.items():
        v = config.get(f, default)
        if v != default:
            flag = flag_name(YarnFields.__dataclass_fields__[f])
            out += [flag] if isinstance(v, bool) else [flag, str(v)]
    return out
