#!/usr/bin/env python
"""Pretrain a GPT. Megatron-LM's flag names; run with `torchrun --nproc-per-node N pretrain_gpt.py ...`
(or plain `python pretrain_gpt.py ...` for one rank). `--help` lists every flag; `--dry-run` validates them,
prints the plan (memory per rank, step time; cluster flags as tools/plan.py's) and exits (docs/planning.md)."""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from megalite.checkpointing.guard import check_save_target
from megalite.checkpointing.load import CheckpointMismatch
from megalite.checkpointing.reader import CheckpointError
from megalite.config import ConfigError, parse_args, validate
from megalite.data.errors import TokenRangeError
from megalite.distributed.launch import distributed_run, launcher_env
from megalite.planning.cli import dry_run
from megalite.training.loop import NonFiniteError, pretrain


@record  # under torchrun, a failing rank's traceback goes to the elastic error file with its rank
def main(argv: list[str] | None = None) -> int:
    _, world, _, local_world = launcher_env()
    if "--dry-run" in (sys.argv[1:] if argv is None else argv):  # no process group, nothing run
        return dry_run(sys.argv[1:] if argv is None else argv, world, local_world)
    cfg = parse_args(argv)
    try:
        validate(cfg, world, local_world)  # before any process group exists
        check_save_target(cfg.checkpoint, cfg.model)  # never replace another run's checkpoint
    except (ConfigError, CheckpointError) as e:
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr)
        return 2
    try:
        with distributed_run(cfg) as pg:
            pretrain(cfg, pg)
    # a damaged --load, a failed save, a NaN, data the tokenizer does not cover: named, no traceback
    except (CheckpointError, CheckpointMismatch, NonFiniteError, TokenRangeError) as e:
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
