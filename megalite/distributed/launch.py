"""Start-up of a run: torch.distributed from the launcher's environment, then this rank's ProcessGroups."""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Iterator

import torch.distributed as dist

from megalite import device
from megalite.config.arguments import MegaliteConfig
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.parallel.report import announce_layout


def launcher_env() -> tuple[int, int, int, int]:
    """(rank, world size, local rank, local world size) from torchrun / Slurm variables."""
    env = os.environ
    rank = int(env.get("RANK", env.get("SLURM_PROCID", 0)))
    world = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", 1)))
    local_rank = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", 0)))
    local_world = int(env.get("LOCAL_WORLD_SIZE", env.get("SLURM_NTASKS_PER_NODE", world)))
    return rank, world, local_rank, local_world


def _attempt_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun, a store whose keys are private to this restart attempt.

    After ``--max-restarts`` brings a job back, the launcher may hand the new workers the same store as
    the failed attempt; its leftover keys (the dead ranks' addresses) would make the new ranks connect
    to processes that no longer exist. A per-attempt prefix keeps each attempt's rendezvous clean."""
    env = os.environ
    if "TORCHELASTIC_RESTART_COUNT" not in env or "MASTER_ADDR" not in env:
        return None
    agent_hosts = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=not agent_hosts and rank == 0,
                         timeout=timeout, multi_tenant=not agent_hosts)
    return dist.PrefixStore(f"megalite/attempt_{env['TORCHELASTIC_RESTART_COUNT']}", base)


def init_distributed(cfg: MegaliteConfig) -> ProcessGroups:
    """Join the process group (if more than one rank) and build this rank's groups.

    Call only after ``validate``: flags are checked before anything is communicated."""
    rank, world, local_rank, local_world = launcher_env()
    p = cfg.parallel
    if world > 1 and not dist.is_initialized():
        device.set_device(local_rank)
        timeout = datetime.timedelta(minutes=p.distributed_timeout_minutes)
        dist.init_process_group(device.backend(), rank=rank, world_size=world, timeout=timeout,
                                store=_attempt_store(rank, world, timeout))
    elif world == 1:
        device.set_device(local_rank)
    layout = RankLayout(world, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                        p.context_parallel_size, p.layout_order, local_world)
    pg = ProcessGroups.build(layout, rank, p.distributed_timeout_minutes, hierarchical_dp=p.hierarchical_dp_reduce)
    announce_layout(pg, p.print_layout)  # rank 0: --print-layout table, TP-across-nodes warnings
    return pg


@contextlib.contextmanager
def distributed_run(cfg: MegaliteConfig) -> Iterator[ProcessGroups]:
    """init_distributed() for an entry point. After the body succeeds every rank meets at a barrier,
    so no rank tears down connections another still uses; the group is destroyed if this call made it,
    and rank 0, which usually hosts the rendezvous store, leaves only after every other rank has."""
    created = not dist.is_initialized()
    pg = init_distributed(cfg)
    ok = False
    try:
        yield pg
        pg.barrier()
        ok = True
    finally:
        if created and dist.is_initialized():
            store = dist.distributed_c10d._get_default_store()
            dist.destroy_process_group()
            if ok:
                _leave_together(store, pg.rank, pg.layout.world_size)


def _leave_together(store: dist.Store, rank: int, world: int, limit_s: float = 30.0) -> None:
    """Count this rank out through the store; rank 0 waits (bounded) until every rank has, so the store
    it may host does not vanish under a rank still tearing down."""
    try:
        left = store.add("megalite/left", 1)
        deadline = time.monotonic() + limit_s
        while rank == 0 and left < world and time.monotonic() < deadline:
            time.sleep(0.05)
            left = store.add("megalite/left", 0)
    except (RuntimeError, OSError):  # a peer's store already gone: nothing left to protect
        pass
