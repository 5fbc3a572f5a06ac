"""One layout's plan: memory per rank against the device, step time and its parts, as a report."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megalite.config.arguments import MegaliteConfig
from megalite.planning import mtp
from megalite.planning.accuracy import accuracy_lines
from megalite.planning.hardware import ClusterConfig
from megalite.planning.headroom import overhead_terms
from megalite.planning.layout import Layout
from megalite.planning.memory import MemoryReport, active_params, layer_params, norm_params, peak_memory, total_params
from megalite.planning.model_shape import EXPERT_FAMILY
from megalite.planning.shape import RunShape
from megalite.planning.timing import TimeReport, crosses_nodes, step_time
from megalite.planning.vocab_balance import layout_hint

GB = 1e9


def fmt_bytes(x: float) -> str:
    return f"{x / GB:9.2f} GB" if abs(x) >= 0.1 * GB else f"{x / 1e6:9.2f} MB"


def fmt_s(x: float) -> str:
    return f"{x * 1e3:12,.1f} ms"


@dataclass
class Plan:
    layout: Layout
    shape: RunShape
    cluster: ClusterConfig
    memory: MemoryReport
    time: TimeReport

    @property
    def fits(self) -> bool:
        """The estimate (CUDA context, NCCL buffers and fragmentation included) fits the device."""
        return self.memory.total <= self.cluster.memory_bytes()

    @property
    def within_headroom(self) -> bool:
        """Fits, but leaves less than --memory-headroom-gb free: --search marks it and does not rank it."""
        return self.fits and self.memory.total > self.cluster.memory_bytes() - self.cluster.memory_headroom_gb * GB

    @property
    def total_params(self) -> int:
        return total_params(self.shape)

    @property
    def active_params(self) -> int:
        """Parameters one token goes through (MoE: k of the routed experts); all of them when dense."""
        return active_params(self.shape)

    @property
    def mtp_params(self) -> int:
        """--mtp-num-layers' depths, counted apart from the model (as DeepSeek-V3 publishes its MTP module)."""
        one = dataclasses.replace(self.shape, tp=1, pp=1, v=1, ep=1, etp=1)
        return mtp.all_params(one, layer_params, norm_params)


def estimate(cfg: MegaliteConfig, cluster: ClusterConfig, vocab: int) -> Plan:
    """The plan of ``cfg``'s layout on ``cluster`` (cfg must be valid for the cluster's world size)."""
    sh = dataclasses.replace(RunShape.of(cfg, cluster.world_size, vocab), te_layers=cluster.model_te_layers)
    mem = peak_memory(sh)
    mem.terms.update(overhead_terms(sh, cluster, mem.terms))
    return Plan(Layout.from_config(cfg), sh, cluster, mem, step_time(sh, cluster))


def _where(sh: RunShape, cl: ClusterConfig, axis: str, size: int) -> str:
    if size == 1:
        return ""
    return " (network)" if crosses_nodes(sh, cl, axis, size) else " (NVLink)"


def _moe_model(plan: Plan) -> str:
    m = plan.shape.cfg.model
    n_moe = plan.shape.model_shape.moe_layers
    if not n_moe:
        return ""
    return (f" ({plan.active_params / 1e9:.2f} B active per token: {m.num_experts} experts, top-"
            f"{m.moe_router_topk}, {n_moe} MoE layers)")


def _mtp(plan: Plan) -> str:
    depths = plan.shape.cfg.model.mtp_num_layers
    return f" + {plan.mtp_params / 1e9:.2f} B in {depths} MTP depth{'s' if depths > 1 else ''}" if depths else ""


def _experts(sh: RunShape, cl: ClusterConfig) -> str:
    if EXPERT_FAMILY not in sh.families:
        return ""
    return (f"; experts: EP {sh.ep}{_where(sh, cl, 'ep', sh.ep)} x expert-TP {sh.etp}{_where(sh, cl, 'etp', sh.etp)}"
            f" x expert-DP {sh.edp}{_where(sh, cl, 'edp', sh.edp)}, {sh.cfg.model.moe_token_dispatcher_type} dispatch")


def _overlap(cl: ClusterConfig) -> str:
    return "; TP comm overlapped (as --tp-comm-overlap)" if cl.model_tp_comm_overlap else ""


def _imbalance(plan: Plan) -> str:
    if not plan.shape.model_shape.moe_layers:
        return ""
    return f"; MoE routing imbalance (max/mean, assumed) {plan.cluster.moe_imbalance:.2f}"


def format_report(plan: Plan) -> str:
    sh, cl, mem, tm = plan.shape, plan.cluster, plan.memory, plan.time
    spec = cl.spec()
    gpu_mem = cl.memory_bytes() / GB
    lines = [
        f"model: {plan.total_params / 1e9:.2f} B parameters{_moe_model(plan)}{_mtp(plan)}, "
        f"{sh.cfg.model.num_layers} layers, "
        f"h={sh.h}, "
        f"s={sh.s}, vocab {sh.vocab} (padded {sh.padded_vocab}), {sh.dtype}",
        f"cluster: {cl.num_nodes} node(s) x {cl.gpus_per_node} {spec.name} = {cl.world_size} GPUs, "
        f"{gpu_mem:.0f} GB, {cl.peak_flops(sh.dtype) / 1e12:.0f} TFLOP/s dense {sh.dtype} peak, GEMMs at up to "
        f"{cl.gemm_flops(sh.dtype) / 1e12:.0f} by shape{_overlap(cl)}{_imbalance(plan)}",
        f"layout: TP {sh.tp}{_where(sh, cl, 'tp', sh.tp)} x CP {sh.cp}{_where(sh, cl, 'cp', sh.cp)} x "
        f"DP {sh.dp}{_where(sh, cl, 'dp', sh.dp)} x PP {sh.pp}{_where(sh, cl, 'pp', sh.pp)}"
        f"{f', {sh.v} virtual stages per rank' if sh.v > 1 else ''}{_experts(sh, cl)}; micro-batch {sh.b}, "
        f"{sh.m} micro-batches per step; SP {'on' if sh.sp else 'off'}; recompute {sh.recompute or 'none'}; "
        f"sharding over DP {sh.cfg.ddp.sharding}",
        f"  flags: {plan.layout.flags()}",
        "",
        f"memory per rank (pipeline rank {mem.stage}, the fullest; {mem.params / 1e9:.3f} B parameters):",
    ]
    for name, value in mem.terms.items():
        lines.append(f"  {name:<24} {fmt_bytes(value)}")
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    if plan.within_headroom:
        verdict += f", but within the {cl.memory_headroom_gb:g} GB headroom (--memory-headroom-gb)"
    lines += [f"  {'total':<24} {fmt_bytes(mem.total)} of {gpu_mem:.0f} GB: {verdict}", "",
              "step time (estimated):"]
    for name, value in tm.terms.items():
        if value or name in ("compute", "pipeline bubble"):
            lines.append(f"  {name:<24} {fmt_s(value)}")
    tokens = sh.m * sh.b * sh.dp * sh.s
    mfu = tm.tflops_per_gpu() * 1e12 / cl.peak_flops(sh.dtype)
    lines += [f"  {'total':<24} {fmt_s(tm.step_s)} per step of {tokens} tokens "
              f"({tokens / tm.step_s / cl.world_size:.0f} tokens/s per GPU)",
              f"  model TFLOP/s per GPU: {tm.tflops_per_gpu():.1f} (MFU {mfu:.1%})"
              + (f"; with recomputation: {tm.tflops_per_gpu(True):.1f}" if sh.recompute == "full" else "")]
    if not plan.fits:
        lines.append("  (does not fit: tools/plan.py --search ranks the layouts that do)")
    hint = layout_hint(sh)  # ZB-V with rank 0 past the zero-bubble memory bound: the layout that fixes it
    lines += [f"  note: {hint}"] if hint else []
    lines += [f"  {line}" for line in accuracy_lines()]
    return "\n".join(lines)
