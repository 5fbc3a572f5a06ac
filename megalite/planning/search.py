"""--search: every layout of the model on the cluster for the run's global batch that the config rules
accept and that fits in device memory, ranked by estimated step time."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from itertools import product
from typing import NamedTuple

from megalite.config.arguments import MegaliteConfig
from megalite.parallel.placement import LayerSplit
from megalite.planning.estimate import Plan, estimate
from megalite.planning.hardware import ClusterConfig
from megalite.planning.layout import Layout, layout_rule_errors
from megalite.planning.model_shape import EXPERT_FAMILY, ModelShape

MICRO_BATCHES = (1, 2, 4, 8)
RECOMPUTE = (None, "selective", "full")


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


class PipeSplit(NamedTuple):
    """A pipeline size and how its layers are cut: even, the loss counted as a layer, or Megatron-LM's
    first/last stage counts (--decoder-first/last-pipeline-num-layers)."""

    pp: int
    loss: bool = False
    first: int | None = None
    last: int | None = None

    @property
    def even(self) -> bool:
        return not self.loss and self.first is None and self.last is None


def candidates(cfg: MegaliteConfig, cluster: ClusterConfig, context_parallel: bool = True) -> Iterator[Layout]:
    """Layouts whose sizes divide the world and whose pipeline split parallel/placement.py accepts
    (``pipeline_splits``): TP and TP x CP inside a node; the distributed optimizer whenever there is more
    than one DP x CP rank (it needs less memory and, with 16-bit weights, moves fewer bytes; ``search``
    tries ZeRO-2, then ZeRO-3, where it does not fit); SP whenever TP > 1 (same bytes, 1/TP of the
    activations). MoE models: every EP that divides the experts and, with expert-TP = TP or 1, the stage's
    ranks."""
    m, world, gpn = cfg.model, cluster.world_size, cluster.gpus_per_node
    gbs = cfg.training.global_batch_size or cfg.training.micro_batch_size
    for tp in divisors(gpn):
        for cp in divisors(gpn // tp) if context_parallel else [1]:
            for split in pipeline_splits(m.num_layers, world // (tp * cp) if world % (tp * cp) == 0 else 0):
                pp = split.pp
                if world % (tp * cp * pp):
                    continue
                dp = world // (tp * cp * pp)
                vps = [None] if not split.even else [None] + [k for k in divisors(m.num_layers // pp)
                                                              if pp > 1 and m.num_layers // (pp * k) > 1]
                for mbs in MICRO_BATCHES:
                    if gbs % (mbs * dp):
                        continue
                    for vp, rc in product(vps, RECOMPUTE):
                        for ep, etp in expert_layouts(cfg, tp * cp * dp, tp):
                            yield Layout(tp, pp, cp, vp, mbs, tp > 1, rc, "optim" if dp * cp > 1 else "no_shard",
                                         ep, etp, split.loss, split.first, split.last)


def pipeline_splits(num_layers: int, world: int | None = None) -> list[PipeSplit]:
    """Every PP dividing the layers (even split); every PP > 1 dividing the layers + 1 (the loss counted as
    a layer: the last stage one layer fewer); and, for every PP > 1 (dividing ``world`` when given),
    ``first_last_splits``. Each passes parallel/placement.py's rules for the split."""
    out = [PipeSplit(pp) for pp in divisors(num_layers) if world is None or world % pp == 0]
    out += [PipeSplit(pp, True) for pp in divisors(num_layers + 1) if pp > 1 and (world is None or world % pp == 0)]
    for pp in range(2, num_layers + 1):
        if world is None or (world and world % pp == 0):
            out += first_last_splits(num_layers, pp)
    return out


def first_last_splits(num_layers: int, pp: int) -> list[PipeSplit]:
    """First/last counts no larger than the other stages' share, that share at most one layer above
    ceil(layers / PP): the layers cut over a PP that does not divide them, and a lighter first stage
    (embedding, most micro-batches in flight) or last stage (output layer and loss) beside one layer more
    on the others. Kept only where LayerSplit accepts them and they differ from the even split."""
    top = -(-num_layers // pp)
    even = LayerSplit(num_layers, pp).counts if num_layers % pp == 0 else None
    out: list[PipeSplit] = []
    for share in (top, top + 1):
        for first, last in _end_counts(num_layers, pp, share):
            split = LayerSplit(num_layers, pp, first=first, last=last)
            if not split.errors() and split.counts != even and max(split.counts) == share:
                out.append(PipeSplit(pp, False, first, last))
    return list(dict.fromkeys(out))


def _end_counts(num_layers: int, pp: int, share: int) -> Iterator[tuple[int | None, int | None]]:
    """(first, last) counts, each 1..share or unset, leaving ``share`` layers to every other stage."""
    for ends in ((True, True), (True, False), (False, True)):
        rest = num_layers - share * (pp - sum(ends))
        if ends == (True, True):
            for first in range(max(1, rest - share), min(share, rest - 1) + 1):
                yield first, rest - first
        elif 1 <= rest <= share:
            yield (rest, None) if ends[0] else (None, rest)


def expert_layouts(cfg: MegaliteConfig, stage_ranks: int, tp: int) -> list[tuple[int, int | None]]:
    """(EP, expert-TP) pairs for a stage of ``stage_ranks`` ranks: EP divides the experts, expert-TP is TP
    (None) or 1, and EP x expert-TP divides the stage's ranks; (1, None) for a model without experts."""
    E = cfg.model.num_experts
    if EXPERT_FAMILY not in ModelShape.of(cfg.model).families:
        return [(1, None)]
    out: list[tuple[int, int | None]] = []
    for etp in dict.fromkeys([tp, 1]):
        for ep in divisors(stage_ranks // etp) if stage_ranks % etp == 0 else []:
            if E % ep == 0:
                out.append((ep, None if etp == tp else etp))
    return out


@dataclass
class SearchResult:
    plans: list[Plan] = field(default_factory=list)  # ranked, fastest first
    considered: int = 0
    too_big: int = 0
    within_headroom: int = 0  # fit, but leave less than --memory-headroom-gb free: not ranked
    refused: Counter = field(default_factory=Counter)  # first broken rule -> layouts


def search(cfg: MegaliteConfig, cluster: ClusterConfig, vocab: int, context_parallel: bool = True) -> SearchResult:
    """``context_parallel=False`` leaves CP out (to compare with runs made without it)."""
    out = SearchResult()
    for layout in candidates(cfg, cluster, context_parallel):
        out.considered += 1
        run = layout.apply(cfg)
        errors = layout_rule_errors(run, cluster.world_size, cluster.gpus_per_node)
        if errors:
            out.refused[errors[0].split(" (")[0]] += 1
            continue
        plan = estimate(run, cluster, vocab)
        # ZeRO-3 does not shard the expert family
        zeros = ("optim_grads",) if EXPERT_FAMILY in plan.shape.families else ("optim_grads", "optim_grads_params")
        for zero in zeros if layout.sharding == "optim" else ():
            if plan.fits and not plan.within_headroom:  # ZeRO-2/3 only where the distributed optimizer alone
                # does not fit with the headroom: they move more
                break
            sharded = replace(layout, sharding=zero)
            plan = estimate(sharded.apply(cfg), cluster, vocab)
        if not plan.fits:
            out.too_big += 1
            continue
        if plan.within_headroom:
            out.within_headroom += 1
            continue
        out.plans.append(plan)
    out.plans.sort(key=lambda p: (p.time.step_s, p.memory.total))
    return out


def reasons(plan: Plan) -> str:
    """The costs beside compute, as shares of the step."""
    t = plan.time
    parts = [f"{name} {v / t.step_s:.0%}" for name, v in t.terms.items() if name != "compute" and v / t.step_s >= 0.005]
    return ", ".join(parts) or "compute only"


def distinct_layouts(result: SearchResult) -> list[tuple[int, int, int]]:
    """(TP, PP, CP) in the order of their fastest plan: the ranking of the ways to cut the model."""
    seen: dict[tuple[int, int, int], None] = {}
    for plan in result.plans:
        seen.setdefault((plan.layout.tp, plan.layout.pp, plan.layout.cp), None)
    return list(seen)


def rank_of(result: SearchResult, tp: int, pp: int, cp: int = 1) -> int | None:
    """1-based rank of (TP, PP, CP) among the distinct layouts that fit (None when none fits)."""
    order = distinct_layouts(result)
    return order.index((tp, pp, cp)) + 1 if (tp, pp, cp) in order else None


def best_variants(result: SearchResult) -> list[Plan]:
    """The fastest plan of each (TP, PP, CP, VP, micro-batch): what differs below it is only the
    recomputation or the optimizer, which the shown flags already choose."""
    seen: dict[tuple, Plan] = {}
    for plan in result.plans:
        lay = plan.layout
        seen.setdefault((lay.tp, lay.pp, lay.cp, lay.vp_layers, lay.micro_batch, lay.ep, lay.etp, lay.account_loss,
                         lay.first_layers, lay.last_layers), plan)
    return list(seen.values())


def label(plan: Plan) -> str:
    lay, sh = plan.layout, plan.shape
    v = sh.v
    experts = (f" EP{sh.ep}" + (f" ETP{sh.etp}" if sh.etp != sh.tp else "")) if EXPERT_FAMILY in sh.families else ""
    pipe = f"TP{lay.tp} PP{lay.pp}" + ("+L" if lay.account_loss else "")  # +L: the loss counted as a layer
    if lay.first_layers is not None or lay.last_layers is not None:  # the first/last stage counts
        pipe += f" {lay.first_layers or '-'}/{lay.last_layers or '-'}"
    return (pipe + (f" VP{v}" if v > 1 else "") + (f" CP{lay.cp}" if lay.cp > 1 else "") + experts
            + f" mbs{lay.micro_batch} {lay.recompute or 'no'}-rc")


def format_search(result: SearchResult, top: int) -> str:
    lines = [f"{result.considered} layouts considered: {len(result.plans)} fit with the headroom, "
             f"{result.within_headroom} fit only within the --memory-headroom-gb headroom (not ranked), "
             f"{result.too_big} need more memory than the device has, {sum(result.refused.values())} refused by "
             "the config rules"]
    for rule, n in result.refused.most_common(3):
        lines.append(f"  refused ({n}): {rule}")
    lines.append("")
    for i, plan in enumerate(best_variants(result)[:top], 1):
        lines.append(f"{i:3d}. {label(plan):<28} {plan.time.step_s * 1e3:9.1f} ms/step  "
                     f"{plan.time.tflops_per_gpu():6.1f} TFLOP/s/GPU  {plan.memory.total / 1e9:6.1f} GB"
                     f"  ({reasons(plan)})")
        lines.append(f"     {plan.layout.flags()}")
    return "\n".join(lines)
