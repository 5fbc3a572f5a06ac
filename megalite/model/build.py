"""build_model(): this rank's model chunks for a layout, initialized identically in every layout."""

from __future__ import annotations

import torch

from megalite import device
from megalite.config.arguments import MegaliteConfig
from megalite.model.gpt import GPTModel
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.init import initialize_parameters
from megalite.tensor_parallel.random import RNGTracker


def build_model(cfg: MegaliteConfig, pg: ProcessGroups, vocab_size: int, tracker: RNGTracker,
                dtype: torch.dtype = torch.float32) -> list[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage), initialized from --seed identically in
    every layout."""
    m, p = cfg.model, cfg.parallel
    split = p.layer_split(m.num_layers)  # the placement checkpoints and the planner read too
    stages = split.stages
    last = stages.last
    ctx = BuildContext(pg, tracker, dtype, device.current_device(), p.sequence_parallel,
                       p.layer_cp_comm_types(m.num_layers))
    chunks = []
    for c in range(split.vp):
        stage = stages.stage(pg.pp_rank, c)
        layers = split.stage_layers(stage)
        chunk = GPTModel(m, ctx, vocab_size, layer_numbers=layers, pre_process=stage == 0, post_process=stage == last)
        initialize_parameters(chunk, pg, cfg.training.seed, m.init_method_std, m.num_layers)
        chunks.append(chunk)
    return chunks
