"""Start-up: torch.distributed from the launcher's environment, process groups, the model."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from megalite import device
from megalite.config.arguments import MegaliteConfig
from megalite.model.gpt import GPTModel
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.parallel.report import announce_layout
from megalite.pipeline.partition import chunk_layers, num_chunks, virtual_stage
from megalite.tensor_parallel.init import initialize_parameters
from megalite.tensor_parallel.random import RNGTracker


def launcher_env() -> tuple[int, int, int, int]:
    """(rank, world size, local rank, local world size) from torchrun / Slurm variables."""
    env = os.environ
    rank = int(env.get("RANK", env.get("SLURM_PROCID", 0)))
    world = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", 1)))
    local_rank = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", 0)))
    local_world = int(env.get("LOCAL_WORLD_SIZE", env.get("SLURM_NTASKS_PER_NODE", world)))
    return rank, world, local_rank, local_world


def init_distributed(cfg: MegaliteConfig) -> ProcessGroups:
    """Join the process group (if more than one rank) and build this rank's groups.

    Call only after ``validate``: flags are checked before anything is communicated."""
    rank, world, local_rank, local_world = launcher_env()
    p = cfg.parallel
    if world > 1 and not dist.is_initialized():
        device.set_device(local_rank)
        dist.init_process_group(device.backend(), rank=rank, world_size=world,
                                 timeout=datetime.timedelta(minutes=p.distributed_timeout_minutes))
    elif world == 1:
        device.set_device(local_rank)
    layout = RankLayout(world, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                        p.context_parallel_size, p.layout_order, local_world)
    pg = ProcessGroups.build(layout, rank, p.distributed_timeout_minutes, hierarchical_dp=p.hierarchical_dp_reduce)
    announce_layout(pg, p.print_layout)  # rank 0: --print-layout table, TP-across-nodes warnings
    return pg


def build_model(cfg: MegaliteConfig, pg: ProcessGroups, vocab_size: int, tracker: RNGTracker,
                dtype: torch.dtype = torch.float32) -> list[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage), initialized from --seed identically in
    every layout."""
    m, p = cfg.model, cfg.parallel
    vp = num_chunks(m.num_layers, pg.pp_size, p.num_layers_per_virtual_pipeline_stage)
    last = pg.pp_size * vp - 1
    chunks = []
    for c in range(vp):
        stage = virtual_stage(pg.pp_rank, c, pg.pp_size)
        chunk = GPTModel(m, pg, vocab_size, tracker, sequence_parallel=p.sequence_parallel, dtype=dtype,
                         device=device.current_device(),
                         layer_numbers=chunk_layers(m.num_layers, pg.pp_size, vp, pg.pp_rank, c),
                         pre_process=stage == 0, post_process=stage == last)
        initialize_parameters(chunk, pg, cfg.training.seed, m.init_method_std, m.num_layers)
        chunks.append(chunk)
    return chunks
