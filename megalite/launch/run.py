"""Start-up of a run: the rendezvous, torch.distributed from the launcher's environment, then this rank's
ProcessGroups; and its teardown, together on success, through the failure board on an error."""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from collections.abc import Iterator
from typing import NoReturn

import torch.distributed as dist

from megalite import device
from megalite.config.arguments import MegaliteConfig
from megalite.launch import rendezvous
from megalite.launch.failure import FailureBoard
from megalite.launch.rendezvous import RendezvousError
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


def run_timeout(cfg: MegaliteConfig) -> datetime.timedelta:
    """--distributed-timeout-minutes (the default when the flag's value is unusable: it is reported as
    a flag error, and that report must still be able to reach the other ranks)."""
    minutes = cfg.parallel.distributed_timeout_minutes
    return datetime.timedelta(minutes=minutes if minutes > 0 and minutes < float("inf") else 10.0)


def init_distributed(cfg: MegaliteConfig, board: FailureBoard | None = None) -> ProcessGroups:
    """Meet the other ranks (bounded by --distributed-timeout-minutes), join the process group (if more
    than one rank) and build this rank's groups. ``board`` learns the store to report failures through.

    Call only after ``validate``: flags are checked before anything is communicated."""
    rank, world, local_rank, local_world = launcher_env()
    p = cfg.parallel
    if world > 1 and not dist.is_initialized():
        device.set_device(local_rank)
        timeout = run_timeout(cfg)
        if board is not None:
            board.may_connect = False  # a failure to reach the store is reported here, not through it
        rv = rendezvous.connect(rank, world, timeout)
        if board is not None:
            board.attach(rv)
        try:
            rendezvous.join(rv, rank, world, timeout)
        except RendezvousError:
            if board is not None:
                board.expected_ranks = rendezvous.joined(rv)  # the store's host waits for these only
            raise
        dist.init_process_group(device.backend(), rank=rank, world_size=world, timeout=timeout, store=rv.store)
    elif world == 1:
        device.set_device(local_rank)
    pg = build_groups(cfg, world, rank, local_world)
    announce_layout(pg, p.print_layout)  # rank 0: --print-layout table, TP-across-nodes warnings
    return pg


def build_groups(cfg: MegaliteConfig, world: int, rank: int, local_world: int | None = None) -> ProcessGroups:
    """This rank's ProcessGroups for the layout the config's parallel flags name, over the joined world."""
    p = cfg.parallel
    layout = RankLayout.from_config(p, world, local_world)
    return ProcessGroups.build(layout, rank, p.distributed_timeout_minutes, hierarchical_dp=p.hierarchical_dp_reduce)


@contextlib.contextmanager
def distributed_run(cfg: MegaliteConfig, board: FailureBoard | None = None) -> Iterator[ProcessGroups]:
    """init_distributed() for an entry point. A failure on this rank is claimed on the failure board
    before any connection closes (``board``, or one of its own when the entry point gives none: its
    peers then leave at once instead of waiting out a collective). After the body succeeds every rank
    meets at a barrier, so no rank tears down connections another still uses; the group is destroyed
    if this call made it, and the store's host leaves only after every other rank has."""
    if dist.is_initialized():  # the caller's group: its teardown and failures are the caller's
        pg = init_distributed(cfg)
        yield pg
        pg.barrier()
        return
    rank, world, _, _ = launcher_env()
    own = board is None
    board = board or FailureBoard(os.path.basename(sys.argv[0]), rank, world, run_timeout(cfg))
    try:
        pg = init_distributed(cfg, board)
        yield pg
        pg.barrier()
        board.detach()
    except BaseException:
        board.claim()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if own or board.first is None:  # else the entry point's board leaves, after printing the error
            board.leave()


def exit_process(code: int | None) -> NoReturn:
    """Leave an entry point with ``code``. A rank of a multi-rank run leaves without the interpreter's
    teardown (``os._exit``, after flushing its output): by then the run has ended cleanly (groups
    destroyed, files closed, every rank counted out), and destroying torch.distributed's C++ threads
    (gloo workers, the rendezvous store's server) during interpreter finalization can abort the process
    ("terminate called without an active exception") and turn a finished run into a failed one."""
    sys.stdout.flush()
    sys.stderr.flush()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        os._exit(code or 0)
    sys.exit(code)
