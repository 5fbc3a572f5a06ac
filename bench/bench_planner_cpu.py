"""The planner against this machine: real training steps at several model sizes, on 1 rank and on 2 gloo
ranks (DP2 and TP2), against tools/plan.py's predicted step time and memory per rank with the `cpu`
preset (bench/measure_cpu.py's figures). One run per case, ratios predicted / measured.

Step time: (the wall time of pretrain() with 4 iterations - with 1) / 3, so the build is left out.
Memory: the peak bytes live in torch's CPU allocator over a 2-step pretrain() (bench/peak_memory.py's
profiler replay, weights to activations), against the planner's tensors (its lines without the
allocator-fragmentation allowance; the cpu preset has no CUDA context and no NCCL buffers). Not max RSS.

    python bench/bench_planner_cpu.py            # prints a markdown table; warns when under load
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch.profiler import record_function  # noqa: E402

from bench.peak_memory import LABEL, measure  # noqa: E402
from megalite.config import validate  # noqa: E402
from megalite.config.arguments import MegaliteConfig  # noqa: E402
from megalite.parallel.groups import ProcessGroups  # noqa: E402
from megalite.parallel.layout import RankLayout  # noqa: E402
from megalite.planning.cli import plan_config  # noqa: E402
from megalite.training.loop import pretrain  # noqa: E402
from tests.harness import run_ranks  # noqa: E402

VOCAB = 1000
# (name, layers, hidden, heads, seq)
SIZES = [("xs", 2, 128, 4, 128), ("s", 2, 256, 4, 128), ("m", 4, 256, 4, 256), ("l", 4, 384, 6, 256),
         ("xl", 4, 512, 8, 256)]
LAYOUTS = [("1 rank", 1, {}), ("DP2", 2, {}), ("TP2", 2, {"tensor_model_parallel_size": 2})]


def flat(size: tuple, world: int, extra: dict, iters: int) -> dict:
    _, layers, h, heads, s = size
    return {"num_layers": layers, "hidden_size": h, "num_attention_heads": heads, "seq_length": s,
            "max_position_embeddings": s, "micro_batch_size": 2, "global_batch_size": 2 * world // extra.get(
                "tensor_model_parallel_size", 1), "train_iters": iters, "eval_iters": 0, "log_interval": 100,
            "attention_backend": "unfused", "mock_data": True, "vocab_size": VOCAB, **extra}


def _run(size: tuple, world: int, extra: dict, rank: int, iters: int) -> float:
    cfg = MegaliteConfig.from_flat(flat(size, world, extra, iters))
    validate(cfg, world)
    pg = ProcessGroups.single() if world == 1 else ProcessGroups.build(
        RankLayout(world, cfg.parallel.tensor_model_parallel_size), rank)
    t0 = time.perf_counter()
    pretrain(cfg, pg, log=lambda s: None)
    return time.perf_counter() - t0


def measure_case(rank: int, world: int, size: tuple, extra: dict) -> tuple[float, int]:
    """(step seconds, peak allocator bytes) of one case on this rank."""
    one = _run(size, world, extra, rank, 1)
    four = _run(size, world, extra, rank, 4)
    with measure() as rep:  # two steps: the second holds the Adam moments and the activations at once
        with record_function(LABEL):
            _run(size, world, extra, rank, 2)
    return max((four - one) / 3, 1e-6), rep.peak


def _worker(rank: int, world: int) -> dict:
    return {(s[0], name): measure_case(rank, world, s, extra) for s in SIZES for name, w, extra in LAYOUTS
            if w == world}


def predicted(size: tuple, world: int, extra: dict, terms: bool = False):
    """(step seconds, tensor bytes per rank) the planner predicts with the cpu preset (terms: its step
    time's terms instead)."""
    f = flat(size, world, extra, 1)
    argv = [arg for k, v in f.items() if k not in ("mock_data", "train_iters", "eval_iters", "log_interval")
            for arg in ([f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)]))]
    plan, _ = plan_config(argv, ["--num-nodes", "1", "--gpus-per-node", str(world), "--gpu", "cpu"])
    if terms:
        return plan.time.terms
    return plan.time.step_s, plan.memory.total - plan.memory.terms["allocator fragmentation"]


def main() -> int:
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    warn = f" (load average {load:.1f} > {cores} cores: times are inflated)" if load > cores else ""
    if warn:
        print(f"warning: machine under load{warn}")
    measured = {**_worker(0, 1), **run_ranks(_worker, 2, timeout=1800)[0]}
    print("| size (layers, h, s) | layout | measured step ms | predicted ms | pred / meas | measured MiB | "
          "predicted MiB | pred / meas |")
    print("|---|---|---|---|---|---|---|---|")
    for size in SIZES:
        for name, world, extra in LAYOUTS:
            t, mem = measured[(size[0], name)]
            pt, pm = predicted(size, world, extra)
            ratio = f"{pt / t:.2f}" if t > 1e-4 else "—"  # below the difference method's noise
            print(f"| {size[0]} ({size[1]}, {size[2]}, {size[4]}) | {name} | {t * 1e3:.1f} | {pt * 1e3:.1f} | "
                  f"{ratio} | {mem / 2**20:.1f} | {pm / 2**20:.1f} | {pm / mem:.2f} |")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}{warn}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
