#!/usr/bin/env python
"""Will it fit, how fast, which layout: memory per rank and estimated step time of a run on a cluster,
from pretrain_gpt.py's own flags plus --num-nodes, --gpus-per-node and --gpu; --search ranks every
valid layout that fits (docs/planning.md). Pure arithmetic: no torch, no GPU, no process group.

    python tools/plan.py --num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 \
        --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 1536 \
        --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --num-nodes 128 --gpus-per-node 8 \
        --gpu a100-80g
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.launch.tool_errors import tool_main  # noqa: E402
from megalite.planning.cli import plan_main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return tool_main("plan.py", lambda: plan_main(argv), error_status=2)


if __name__ == "__main__":
    sys.exit(main())
