"""The one list of Hugging Face architectures megalite converts, and how an adapter is found.

Import: by the HF config's ``model_type`` (or an adapter's alias). Export: a ``model_type`` when the caller
names one, else the first adapter in ``ADAPTERS`` whose ``matches(cfg)`` holds, so a family that refines
another (a Llama-style model with one more feature) is listed before the one it refines. Adding a family:
one module in families/ (defining ``ADAPTER``; the package imports every module in it) and one line in
``ADAPTERS``.
"""

from __future__ import annotations

from megalite.checkpointing.hf import families
from megalite.checkpointing.hf.adapter import HFAdapter
from megalite.checkpointing.hf.common import HFConversionError
from megalite.config.model import ModelConfig

# export tries them in this order: a family that refines another comes before it
ADAPTERS: list[HFAdapter] = [
    families.gpt2.ADAPTER,
    families.gemma3.ADAPTER,
    families.gemma2.ADAPTER,
    families.deepseek_v3.ADAPTER,
    families.mixtral.ADAPTER,
    families.qwen2_moe.ADAPTER,
    families.qwen3_moe.ADAPTER,
    families.qwen3.ADAPTER,
    families.olmo2.ADAPTER,
    families.qwen2.ADAPTER,
    families.mistral.ADAPTER,
    families.llama.ADAPTER,
]


def register(adapter: HFAdapter, before: str | None = None) -> None:
    """Add an adapter (a family defined outside this package, or in a test); ``before``: the model_type of
    the adapter it refines, so export tries it first. A model_type registered twice is refused."""
    taken = {t for a in ADAPTERS for t in a.model_types}
    clash = taken.intersection(adapter.model_types)
    if clash:
        raise ValueError(f"model_type {sorted(clash)[0]!r} already has an adapter")
    at = next((i for i, a in enumerate(ADAPTERS) if before in a.model_types), len(ADAPTERS))
    ADAPTERS.insert(at, adapter)


def unregister(adapter: HFAdapter) -> None:
    ADAPTERS.remove(adapter)


def supported() -> str:
    """The architectures from-hf reads, for error messages."""
    return ", ".join(a.describe() for a in ADAPTERS)


def for_model_type(model_type: str | None, where: str, architectures=None) -> HFAdapter:
    """The adapter of an HF config's model_type, or an error naming what is supported."""
    for a in ADAPTERS:
        if model_type in a.model_types:
            return a
    raise HFConversionError(f"{where}: unsupported architecture (model_type {model_type!r}, architectures "
                            f"{architectures}); from-hf reads {supported()}")


def for_hf_config(hf_config, where: str) -> HFAdapter:
    return for_model_type(getattr(hf_config, "model_type", None), where, getattr(hf_config, "architectures", None))


def for_export(cfg: ModelConfig, model_type: str | None = None) -> HFAdapter:
    """The adapter a megalite config exports to (module doc), or an error listing, nearest first, what each
    architecture needs and what this model lacks."""
    candidates = ADAPTERS if model_type is None else [for_model_type(model_type, "export")]
    for a in candidates:
        if a.matches(cfg):
            return a
    missing = [(a, [k for k, ok in a.export_requirements(cfg).items() if not ok]) for a in candidates]
    missing.sort(key=lambda am: len(am[1]))
    raise HFConversionError("this model has no Hugging Face equivalent: " + "; ".join(
        f"{a.architecture} needs {', '.join(a.export_requirements(cfg))} (missing: {', '.join(lack)})"
        for a, lack in missing))
