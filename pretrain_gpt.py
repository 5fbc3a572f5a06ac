#!/usr/bin/env python
"""Pretrain a GPT. Megatron-LM's flag names; run with `torchrun --nproc-per-node N pretrain_gpt.py ...`
(or plain `python pretrain_gpt.py ...` for one rank). `--help` lists every flag; `--dry-run` validates them,
prints the plan (memory per rank, step time; cluster flags as tools/plan.py's) and exits (docs/planning.md)."""

from __future__ import annotations

import contextlib
import io
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from megalite import device
from megalite.checkpointing.guard import guarded_save
from megalite.checkpointing.load import CheckpointMismatch
from megalite.checkpointing.reader import CheckpointError
from megalite.config import ConfigError, MegaliteConfig, parse_args
from megalite.config.written import validate_as_written
from megalite.data.errors import DataError
from megalite.launch.failure import FailureBoard
from megalite.launch.rendezvous import RendezvousError
from megalite.launch.run import distributed_run, exit_process, launcher_env, run_timeout
from megalite.optimizer.loss_scaler import LossScaleCollapse
from megalite.planning.cli import dry_run
from megalite.planning.memory_check import MemoryCheckError, check_memory
from megalite.training.loop import NonFiniteError, pretrain

PROG = "pretrain_gpt.py"
# Failures the user can act on: one line naming the flag, file or rank, no traceback. Anything else is
# a bug and keeps its traceback.
EXPECTED: tuple[type[BaseException], ...] = (
    ConfigError, RendezvousError,  # flags; ranks that never met
    CheckpointError, CheckpointMismatch,  # a damaged or foreign --load, a refused or failed save
    NonFiniteError, LossScaleCollapse,  # a diverged run
    DataError,  # data or tokenizer files the run cannot use (missing, corrupt, token ids past the vocab)
    MemoryCheckError,  # the planner's bytes per rank exceed the device's (or the host's) memory
)


def _parse(argv: list[str] | None, rank: int, world: int) -> MegaliteConfig:
    """parse_args(); under a launcher only rank 0 prints a flag error (every rank parses the same
    command line and fails the same way)."""
    if world == 1 or rank == 0:
        return parse_args(argv)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            cfg = parse_args(argv)
    except SystemExit as e:
        if e.code:
            sys.exit(2)  # rank 0 says why
        raise
    sys.stderr.write(err.getvalue())
    return cfg


def _check_memory(cfg: MegaliteConfig, rank: int, world: int, local_rank: int, local_world: int) -> None:
    """The planner's bytes per rank against this device's memory, before anything is allocated: raises
    MemoryCheckError past it (unless --skip-memory-check); rank 0 prints why the check could not be made."""
    warning = check_memory(cfg, world, device.memory_capacity(local_rank, local_world))
    if warning and rank == 0:
        print(f"{PROG}: warning: {warning}", file=sys.stderr, flush=True)


def _note(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


@record  # under torchrun, a bug's traceback goes to the elastic error file with its rank
def main(argv: list[str] | None = None) -> int:
    rank, world, local_rank, local_world = launcher_env()
    if "--dry-run" in (sys.argv[1:] if argv is None else argv):  # no process group, nothing run
        return dry_run(sys.argv[1:] if argv is None else argv, world, local_world)
    cfg = _parse(argv, rank, world)
    board = FailureBoard(PROG, rank, world, run_timeout(cfg))
    with board.reporting(EXPECTED):
        validate_as_written(cfg, world, local_world)  # before any process group exists
        _check_memory(cfg, rank, world, local_rank, local_world)  # before any process group or tensor
        # one writer per --save folder; never replace another run's checkpoint
        with guarded_save(cfg.checkpoint, cfg.model, rank, _note), distributed_run(cfg, board) as pg:
            pretrain(cfg, pg)
    return board.exit_code


if __name__ == "__main__":
    exit_process(main())
