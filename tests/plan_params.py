"""The planner's parameter count of an imported Hugging Face family against transformers' own count."""

from __future__ import annotations

from megalite.checkpointing.metadata import model_config
from megalite.checkpointing.reader import CheckpointReader
from megalite.config.arguments import MegaliteConfig
from megalite.planning.memory import total_params
from megalite.planning.shape import RunShape


def assert_planner_counts_hf(p) -> None:
    """``total_params`` of the from-hf checkpoint's model equals ``num_parameters()`` of the transformers
    model (the families' vocabularies are multiples of the padding unit, so no padded rows count)."""
    cfg, vocab = model_config(CheckpointReader(p.imported).config)
    assert vocab % cfg.make_vocab_size_divisible_by == 0, "pick a vocabulary with no padding"
    plan = total_params(RunShape.of(MegaliteConfig(model=cfg), 1, vocab))
    want = p.hf_model.num_parameters()
    assert plan == want, f"{p.family.name}: the planner counts {plan} parameters, transformers {want}"
