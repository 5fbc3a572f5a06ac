"""The model's description of itself, layer by layer, as the planner sums it.

Every memory, time and FLOP term of the transformer layers is a sum over the layers of a term of the
layer's kind (``LayerShape``), so a dense model is simply one whose layers are all dense, an MoE model one
with some MoE layers (Megatron's --moe-layer-freq), and no term asks which kind of model it is. A layer's
kind is read from the same config method the model builds the layer from (``ModelConfig.moe_layers()``,
read by model/transformer.py's ``TransformerLayer``), and its parameters fall into the families the
runtime cuts, averages and counts them by (tensor_parallel/param_meta.py's ``ParamFamily``, named here:
the planner imports no torch); tests/test_planning_moe.py builds the model and checks both agree.

The attention kind is per layer too, from ``ModelConfig.attention_windows()`` (what the model's Attention
reads): "causal" over the whole past, or "local" with its ``window`` (--window-size, --window-attn-skip-freq),
whose QK^T and PV cost follows the window (flops.layer_flops_per_token, kernels.attention_s). Its saved
activations are the causal kind's (memory.core_attention_bytes unchanged): the blockwise path keeps q, k, v,
the output and the log-sum-exp as flash attention does; 'unfused'/'local' mask the same s x s scores.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property, lru_cache

from megalite.config.model import ModelConfig

DENSE_FAMILY, EXPERT_FAMILY = "dense", "expert"  # ParamFamily.name of param_meta.DENSE / param_meta.EXPERT
FAMILY_ORDER = (DENSE_FAMILY, EXPERT_FAMILY)  # as param_meta.FAMILIES keeps them


@dataclass(frozen=True)
class LayerShape:
    """One transformer layer's kind: what its terms depend on besides the run's sizes."""

    mlp: str = "dense"  # "dense": an MLP; "moe": router, routed experts (the expert family), optional shared expert
    attention: str = "causal"  # "causal": the whole causal past; "local": the ``window`` latest keys
    window: int = 0  # keys a query sees in a "local" layer (itself included)

    def keys_per_query(self, seq_length: int) -> int:
        """The keys one query's score row spans, counted over the full square as Megatron counts causal
        attention: the sequence, or the window when it is shorter."""
        return min(self.window, seq_length) if self.attention == "local" else seq_length

    @property
    def moe(self) -> bool:
        return self.mlp == "moe"

    @property
    def families(self) -> tuple[str, ...]:
        """The parameter families the layer's parameters belong to."""
        return (DENSE_FAMILY, EXPERT_FAMILY) if self.moe else (DENSE_FAMILY,)


DENSE_LAYER, MOE_LAYER = LayerShape(), LayerShape(mlp="moe")


@dataclass(frozen=True)
class ModelShape:
    """The kind of each of the model's layers, in order."""

    layers: tuple[LayerShape, ...]

    @classmethod
    def of(cls, model: ModelConfig) -> ModelShape:
        """Each layer as the model builds it (``moe_layers()``: all False for a model without experts)."""
        return _model_shape(tuple(model.moe_layers()), tuple(model.attention_windows()))

    @cached_property
    def families(self) -> tuple[str, ...]:
        """The parameter families the model has (param_meta.model_families' list, by name)."""
        present = {f for layer in self.kinds for f in layer.families}
        return tuple(f for f in FAMILY_ORDER if f in present)

    @cached_property
    def kinds(self) -> tuple[LayerShape, ...]:
        """The distinct layer kinds, in order of first appearance."""
        return tuple(dict.fromkeys(self.layers))

    @cached_property
    def _kind_index(self) -> tuple[int, ...]:
        return tuple(self.kinds.index(layer) for layer in self.layers)

    @property
    def moe_layers(self) -> int:
        return sum(layer.moe for layer in self.layers)

    def count(self, numbers: Iterable[int]) -> dict[LayerShape, int]:
        """How many of the layers numbered ``numbers`` are of each kind (kinds in order of first appearance)."""
        counts: dict[int, int] = {}
        for i in numbers:
            k = self._kind_index[i]
            counts[k] = counts.get(k, 0) + 1
        return {self.kinds[k]: n for k, n in counts.items()}


@lru_cache(maxsize=256)
def _model_shape(moe: tuple[bool, ...], windows: tuple[int, ...] | None = None) -> ModelShape:
    """One shape per layer pattern (a --search plans thousands of layouts of one model)."""
    windows = windows or (0,) * len(moe)
    return ModelShape(tuple(LayerShape(mlp="moe" if m else "dense", attention="local" if w else "causal", window=w)
                            for m, w in zip(moe, windows)))
