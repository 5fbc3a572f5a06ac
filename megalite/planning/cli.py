"""The command lines: tools/plan.py (report or --search) and pretrain_gpt.py --dry-run.

Both take pretrain_gpt.py's own flags (the same parser, so the same names, --config files and errors)
plus the cluster flags of ClusterConfig; the cluster flags are taken out first and the rest goes to
megalite.config.parse_args.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megalite.config.arguments import MegaliteConfig, build_parser, parse_args
from megalite.config.domain import MAX_COUNT, Domain, domain_option
from megalite.config.flags import add_dataclass_flags
from megalite.config.validate import ConfigError, domain_check, fill_derived_defaults
from megalite.config.written import validate_as_written
from megalite.planning.estimate import estimate, format_report
from megalite.planning.hardware import ClusterConfig, cluster_errors
from megalite.planning.layout import Layout, layout_rule_errors
from megalite.planning.search import distinct_layouts, format_search, rank_of, search

DEFAULT_VOCAB = 50257  # GPT-2's BPE, when neither --vocab-size nor a vocab file says otherwise


def _planner_flags(parser: argparse.ArgumentParser, dry_run: bool) -> None:
    add_dataclass_flags(parser, ClusterConfig)
    group = parser.add_argument_group("planner")
    if dry_run:
        group.add_argument("--dry-run", action="store_true", default=argparse.SUPPRESS,
                           help="Validate the flags, build no process group, print the plan and exit.")
    else:
        group.add_argument("--search", action="store_true", default=argparse.SUPPRESS,
                           help="Rank every valid layout that fits, for this model, global batch and cluster.")
        domain_option(group, "--top", domain=Domain(lo=1, hi=MAX_COUNT), integer=True, default=argparse.SUPPRESS,
                      help="Layouts --search shows (default 10).")


def split_argv(argv: Sequence[str], dry_run: bool = False) -> tuple[dict, list[str]]:
    """(the planner's flag values given, the remaining flags for parse_args). --help prints both sets."""
    if "-h" in argv or "--help" in argv:
        parser = build_parser()
        parser.description = ("Print the plan of a run: memory per rank and step time on a cluster; "
                              "--search ranks the layouts (docs/planning.md).")
        parser.conflict_handler = "resolve"  # --peak-tflops is a run flag and a cluster flag: one help line
        _planner_flags(parser, dry_run)
        parser.print_help()
        sys.exit(0)
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _planner_flags(parser, dry_run)
    ns, rest = parser.parse_known_args(list(argv))
    return vars(ns), rest


def vocab_of(cfg: MegaliteConfig) -> int:
    """The model's vocabulary: --vocab-size V (NullTokenizer, ids 0..V-1 plus the eod id), else (unset)
    GPT-2's; a V outside its domain (0, negative) is refused by the domain check before this is asked."""
    return cfg.data.vocab_size + 1 if cfg.data.vocab_size is not None else DEFAULT_VOCAB


def cluster_from_values(values: dict) -> ClusterConfig:
    return ClusterConfig(**{k: v for k, v in values.items() if k in ClusterConfig.__dataclass_fields__})


def plan_config(run_flags: list[str], cluster_flags: list[str]):
    """(the plan, its config) of pretrain_gpt.py flags on planner cluster flags; a broken rule raises
    ConfigError naming it."""
    values, rest = split_argv([*run_flags, *cluster_flags])
    cfg, cluster = parse_args(rest), cluster_from_values(values)
    errors = cluster_errors(cluster) + domain_check(cfg)
    errors = errors or layout_rule_errors(cfg, cluster.world_size, cluster.gpus_per_node)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    fill_derived_defaults(cfg, cluster.world_size)
    return estimate(cfg, cluster, vocab_of(cfg)), cfg


def _fail(prog: str, errors: list[str]) -> int:
    print(f"{prog}: error: invalid configuration:\n  " + "\n  ".join(errors), file=sys.stderr)
    return 2


def plan_main(argv: Sequence[str] | None = None, prog: str = "plan.py") -> int:
    values, rest = split_argv(sys.argv[1:] if argv is None else argv)
    cfg = parse_args(rest)
    cluster = cluster_from_values(values)
    errors = cluster_errors(cluster) + domain_check(cfg)  # first and alone, --search included
    if errors:
        return _fail(prog, errors)
    vocab = vocab_of(cfg)
    if values.get("search"):
        result = search(cfg, cluster, vocab)
        print(f"search: {cfg.model.num_layers} layers, h={cfg.model.hidden_size}, s={cfg.model.seq_length}, "
              f"global batch {cfg.training.global_batch_size or cfg.training.micro_batch_size} on "
              f"{cluster.num_nodes} x {cluster.gpus_per_node} {cluster.gpu}, ranked by estimated step time")
        print(format_search(result, values.get("top", 10)))
        mine = Layout.from_config(cfg)
        if (mine.tp, mine.pp) != (1, 1):
            r = rank_of(result, mine.tp, mine.pp)
            print(f"\nthe given TP {mine.tp} x PP {mine.pp}: "
                  + (f"rank {r} of {len(distinct_layouts(result))} distinct TP x PP x CP layouts that fit" if r
                     else "no such layout fits"))
        return 0
    errors = layout_rule_errors(cfg, cluster.world_size, cluster.gpus_per_node)
    if errors:
        return _fail(prog, errors)
    fill_derived_defaults(cfg, cluster.world_size)
    print(format_report(estimate(cfg, cluster, vocab)))
    return 0


def dry_run(argv: Sequence[str], world: int, local_world: int) -> int:
    """pretrain_gpt.py --dry-run: the run's full validation, then the plan; no process group. The world
    is --num-nodes x --gpus-per-node when given, else the launcher's (WORLD_SIZE, LOCAL_WORLD_SIZE)."""
    values, rest = split_argv(argv, dry_run=True)
    cfg = parse_args(rest)
    if "num_nodes" not in values and "gpus_per_node" not in values:
        values["gpus_per_node"] = local_world
        values["num_nodes"] = max(world // max(local_world, 1), 1)
    cluster = cluster_from_values(values)
    errors = cluster_errors(cluster)
    try:
        if not errors:  # the world size is a product of cluster flags: only in their domain
            validate_as_written(cfg, cluster.world_size, cluster.gpus_per_node)
    except ConfigError as e:
        errors += str(e).splitlines()[1:]
    if errors:
        return _fail("pretrain_gpt.py", [e.strip() for e in errors])
    print(format_report(estimate(cfg, cluster, vocab_of(cfg))))
    return 0
