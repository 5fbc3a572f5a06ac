"""Where a CPU training step's time goes, against the planner's terms (bench/README.md, "The planner on
this machine"): bench_planner_cpu.py's single-rank steps profiled with torch.profiler, the self time of
every operator per step (a (1 + k)-iteration run minus a 1-iteration run, so the build is left out) put
in four groups: the GEMMs (mm, addmm, bmm, baddbmm: the planner's "compute"), dropout's random masks
(bernoulli_), the optimizer's operators (AdamW's elementwise updates: "optimizer step") and everything
else (the elementwise work of the layers, the loss and autograd's bookkeeping: "memory-bound work"),
with the operator calls per step of the last group, and the minor page faults per step (first touches of
memory the allocator mapped afresh, which the planner does not model: their count is the allocator's).

    OMP_NUM_THREADS=1 python bench/profile_planner_cpu.py [sizes...]   # default: s m l xl
"""

from __future__ import annotations

import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench.bench_planner_cpu import SIZES, _run, predicted  # noqa: E402

GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
OPTIMIZER = {"aten::lerp_", "aten::addcdiv_", "aten::addcmul_", "aten::_foreach_lerp_", "aten::_foreach_addcdiv_",
             "aten::_foreach_addcmul_", "aten::_foreach_mul_", "aten::_foreach_sqrt", "aten::_foreach_add_",
             "aten::_foreach_div_", "aten::_foreach_maximum_"}
GROUPS = ("gemm", "dropout masks", "optimizer", "other")


def _group(name: str) -> str:
    if name in GEMMS:
        return "gemm"
    if name == "aten::bernoulli_":
        return "dropout masks"
    if name in OPTIMIZER or name.startswith("Optimizer."):
        return "optimizer"
    return "other"


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _profiled(size: tuple, iters: int) -> tuple[dict[str, float], int, int]:
    """(self seconds per group, operator calls of "other", minor page faults) of one run of ``iters``
    iterations."""
    faults = _faults()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _run(size, 1, {}, 0, iters)
    faults = _faults() - faults
    out, calls = dict.fromkeys(GROUPS, 0.0), 0
    for e in prof.key_averages():
        g = _group(e.key)
        out[g] += e.self_cpu_time_total / 1e6
        calls += e.count if g == "other" and e.key.startswith("aten::") else 0
    return out, calls, faults


def profile_size(size: tuple, iters: int = 3) -> tuple[dict[str, float], float, float]:
    """(self seconds per group per step, "other" operator calls per step, minor page faults per step)."""
    _run(size, 1, {}, 0, 1)  # warm up
    one, one_calls, one_faults = _profiled(size, 1)
    many, many_calls, many_faults = _profiled(size, 1 + iters)
    return ({g: (many[g] - one[g]) / iters for g in GROUPS}, (many_calls - one_calls) / iters,
            (many_faults - one_faults) / iters)


def main(names: list[str]) -> int:
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores:
        print(f"warning: load average {load:.1f} > {cores} cores: times are inflated")
    print("| size | GEMMs ms (predicted compute) | other ms (predicted memory-bound + operator calls + score passes) "
          "| other calls | page faults | dropout masks ms (predicted) | optimizer ms (predicted) |")
    print("|---|---|---|---|---|---|---|")
    for size in [s for s in SIZES if s[0] in names]:
        per, calls, faults = profile_size(size)
        plan = predicted(size, 1, {}, terms=True)
        other = sum(plan.get(k, 0.0) for k in ("memory-bound work", "operator calls", "attention score passes"))
        print(f"| {size[0]} | {per['gemm'] * 1e3:.1f} ({plan['compute'] * 1e3:.1f}) | {per['other'] * 1e3:.1f} "
              f"({other * 1e3:.1f}) | {calls:.0f} | {faults:.0f} | {per['dropout masks'] * 1e3:.1f} "
              f"({plan.get('dropout masks', 0.0) * 1e3:.1f}) | {per['optimizer'] * 1e3:.1f} "
              f"({plan['optimizer step'] * 1e3:.1f}) |")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["s", "m", "l", "xl"]))
