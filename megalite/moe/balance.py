"""Step-level MoE bookkeeping: the step's loss scaling handed to the layers, the expert-bias update, the
logged metrics.

Token counts are summed over every rank of a pipeline stage (expert-model-parallel, then expert-data-
parallel group: together the stage's TP x CP x DP ranks) and over the step's micro-batches, so the
expert bias moves as in the single-process run.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite import device
from megalite.moe.layer import MoELayer
from megalite.parallel.groups import Group, ProcessGroups
from megalite.parallel.loss_scaling import LossScaling


def moe_layers(chunks: list[nn.Module]) -> list[MoELayer]:
    return [m for c in chunks for m in c.modules() if isinstance(m, MoELayer)]


def set_loss_scaling(chunks: list[nn.Module], scaling: LossScaling) -> None:
    """Hand the step's scaling to the MoE layers: their aux terms' gradient is ``scaling.aux_grad_scale``."""
    for layer in moe_layers(chunks):
        layer.aux_grad_scale = scaling.aux_grad_scale


def _stage_sum(t: torch.Tensor, pg: ProcessGroups) -> torch.Tensor:
    pg.all_reduce(t, Group.EMP)
    pg.all_reduce(t, Group.EDP)
    return t


@torch.no_grad()
def update_expert_bias(chunks: list[nn.Module], pg: ProcessGroups) -> None:
    """--moe-router-enable-expert-bias: bias += rate * sign(mean count - count), from the step's global
    counts (then cleared). Runs after every optimizer step, skipped or not (the counts are the router's)."""
    layers = moe_layers(chunks)
    if not layers or not layers[0].cfg.moe_router_enable_expert_bias:
        for m in layers:
            m.stats.step_counts.zero_()
        return
    counts = _stage_sum(torch.stack([m.stats.step_counts for m in layers]), pg)
    for m, c in zip(layers, counts):
        bias = m.router.expert_bias
        if bias is not None:
            bias += m.cfg.moe_router_bias_update_rate * torch.sign(c.mean() - c)
        m.stats.step_counts.zero_()


@torch.no_grad()
def window_metrics(chunks: list[nn.Module], pg: ProcessGroups, num_layers: int, num_experts: int) -> dict:
    """Per MoE layer over the logging window (then cleared): load-balancing and z loss (mean per
    micro-batch), tokens-per-expert imbalance (max / mean of the global counts) and the dropped fraction.
    Every rank calls it (one world all-reduce). Returns {"layers": {n: {...}}, and the means over layers}."""
    layers = moe_layers(chunks)
    # a stage without MoE layers still joins the all-reduce: its table on the compute device (NCCL), too
    dev = layers[0].stats.counts.device if layers else device.current_device()
    table = torch.zeros((num_layers, num_experts + 4), dtype=torch.float32, device=dev)
    for m in layers:
        st = m.stats
        table[m.layer_number, :num_experts] = st.counts
        table[m.layer_number, num_experts:] = torch.stack([st.lb_loss, st.z_loss, st.dropped,
                                                           torch.tensor(float(st.microbatches), device=dev)])
        m.stats = type(st).zeros(num_experts, dev)
        m.stats.step_counts = st.step_counts
    # every layer lives on one stage; its micro-batch count is summed over the stage's DP replicas below
    pg.all_reduce(table, Group.WORLD)
    out: dict = {"layers": {}}
    scaling = LossScaling.of(pg)
    for n in range(num_layers):
        row = table[n]
        counts, (lb, z, dropped, mbs) = row[:num_experts], row[num_experts:].tolist()
        if mbs == 0:
            continue
        mbs = scaling.moe_microbatches(mbs)
        assigned = float(counts.sum())
        out["layers"][n] = {"load_balancing_loss": lb / mbs, "z_loss": z / mbs,
                            "imbalance": float(counts.max() / counts.mean()) if assigned else 0.0,
                            "dropped_fraction": dropped / assigned if assigned else 0.0}
    rows = list(out["layers"].values())
    for key in ("load_balancing_loss", "z_loss", "imbalance", "dropped_fraction"):
        out[key] = sum(r[key] for r in rows) / len(rows) if rows else 0.0
    return out
