#!/usr/bin/env python
"""Print which ranks form which TP/DP/PP group on which node, without starting a run.

Pure arithmetic (no torch.distributed), with the same flags as pretrain_gpt.py, so a layout can be checked
for a cluster before asking for it:

    python tools/show_layout.py --world-size 16 --nproc-per-node 8 --tensor-model-parallel-size 4 \\
        --pipeline-model-parallel-size 2 [--use-tp-pp-dp-mapping] [--hierarchical-dp-reduce]
        [--context-parallel-size 4 --hierarchical-context-parallel-sizes 2 2]

Exit status 0, or 1 when a warning applies (a TP group crosses nodes) and --strict is given; 2 when the
layout is impossible (world not divisible by TP x PP, uneven hierarchical split, hierarchical CP sizes
that do not multiply to the CP size).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megalite.config.domain import MAX_RANKS, domain_option, size  # noqa: E402
from megalite.config.flags import add_dataclass_flags, domain_errors  # noqa: E402
from megalite.config.parallel import ParallelConfig  # noqa: E402
from megalite.launch.tool_errors import tool_main  # noqa: E402
from megalite.parallel.layout import RankLayout  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return tool_main("show_layout.py", lambda: _main(argv), error_status=2)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ranks = dict(domain=size(MAX_RANKS), integer=True)
    domain_option(parser, "--world-size", **ranks, help="Total ranks (default nnodes x nproc-per-node).")
    domain_option(parser, "--nproc-per-node", **ranks, default=8, help="Ranks per node (torchrun's flag).")
    domain_option(parser, "--nnodes", **ranks, default=1, help="Nodes, when --world-size is not given.")
    parser.add_argument("--all", action="store_true", help="List every group (default: 16 per kind).")
    parser.add_argument("--strict", action="store_true", help="Exit 1 when the layout has a warning.")
    add_dataclass_flags(parser, ParallelConfig)
    ns = vars(parser.parse_args(argv))
    p = ParallelConfig(**{k: v for k, v in ns.items() if k in ParallelConfig.__dataclass_fields__})
    if errors := domain_errors(p):  # before the layout divides by any size
        print("show_layout.py: error: " + "; ".join(errors), file=sys.stderr)
        return 2
    world = ns["world_size"] or ns["nnodes"] * ns["nproc_per_node"]
    try:
        layout = RankLayout.from_config(p, world, ns["nproc_per_node"])
        text = layout.describe(limit=None if ns["all"] else 16, hierarchical_dp=p.hierarchical_dp_reduce)
    except ValueError as e:
        print(f"show_layout.py: error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 1 if ns["strict"] and layout.warnings() else 0


if __name__ == "__main__":
    sys.exit(main())
