"""The rules of the pipeline split flags (Megatron-LM's uneven stages, virtual stages and layout string),
checked before any process group exists. Which layers each stage then holds is parallel/placement.py's
``LayerSplit``; its own arithmetic rules (divisibility, counts adding up) are ``LayerSplit.errors``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megalite.config.arguments import MegaliteConfig
    from megalite.config.parallel import ParallelConfig
    from megalite.parallel.placement import LayerSplit

FIRST_LAST = "--decoder-first/last-pipeline-num-layers"


def _uneven_flags(p: "ParallelConfig") -> list[str]:
    """The uneven-split flags given, by name."""
    return [f for f, on in (("--decoder-first-pipeline-num-layers", p.decoder_first_pipeline_num_layers is not None),
                            ("--decoder-last-pipeline-num-layers", p.decoder_last_pipeline_num_layers is not None),
                            ("--account-for-embedding-in-pipeline-split", p.account_for_embedding_in_pipeline_split),
                            ("--account-for-loss-in-pipeline-split", p.account_for_loss_in_pipeline_split)) if on]


def split_flag_errors(p: "ParallelConfig") -> list[str]:
    """Which split flags go together (Megatron-LM's rules): the virtual-stage flags are exclusive, the
    first/last counts take --num-virtual-stages-per-pipeline-rank, a layout string takes no other split flag."""
    errors = []
    k, v = p.num_layers_per_virtual_pipeline_stage, p.num_virtual_stages_per_pipeline_rank
    uneven = _uneven_flags(p)
    if k is not None and v is not None:
        errors.append("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank are "
                      "exclusive (both set the model chunks per rank)")
    if k is not None and (p.decoder_first_pipeline_num_layers is not None
                          or p.decoder_last_pipeline_num_layers is not None):
        errors.append(f"{FIRST_LAST} need --num-virtual-stages-per-pipeline-rank, not "
                      "--num-layers-per-virtual-pipeline-stage, for virtual stages (as Megatron-LM)")
    if p.pipeline_model_parallel_layout is not None:
        others = uneven + [f for f, on in (("--num-layers-per-virtual-pipeline-stage", k is not None),
                                           ("--num-virtual-stages-per-pipeline-rank", v is not None)) if on]
        if others:
            errors.append(f"--pipeline-model-parallel-layout sets every stage's layers itself; drop {others[0]}")
    for flag, given in (("--num-virtual-stages-per-pipeline-rank", v is not None),
                        ("--pipeline-model-parallel-layout", p.pipeline_model_parallel_layout is not None)):
        if given and p.pipeline_model_parallel_size == 1:
            errors.append(f"{flag} needs --pipeline-model-parallel-size > 1")
    if v is not None and p.pipeline_schedule in ("zb-h1", "zbv"):
        chunks = "two per rank" if p.pipeline_schedule == "zbv" else "one per rank"
        errors.append(f"--pipeline-schedule {p.pipeline_schedule} places its own model chunks ({chunks}); drop "
                      "--num-virtual-stages-per-pipeline-rank")
    return errors


def checked_split(cfg: "MegaliteConfig") -> tuple[list[str], "LayerSplit | None"]:
    """(the split flags' combination and layout-syntax errors, the split when there are none); the split's
    own arithmetic rules are ``layout_errors``'s (``LayerSplit.errors``)."""
    p = cfg.parallel
    errors = split_flag_errors(p)
    if errors or p.pipeline_model_parallel_size <= 0:
        return errors, None
    try:
        split = p.layer_split(cfg.model.num_layers)
    except ValueError as e:  # the layout string's syntax
        return [str(e)], None
    if p.pipeline_schedule == "zb-h1" and split.vp != 1:
        return [f"--pipeline-schedule zb-h1 runs one model chunk per rank: --pipeline-model-parallel-layout needs "
                f"--pipeline-model-parallel-size ({split.pp}) stages, not {split.n}"], None
    return [], split
