"""Mixture of experts (docs/moe.md), fp32 on CPU:

1. bytes: ``ProcessGroups.comm_bytes`` of the token dispatch over the steps of real ``pretrain()`` runs on
   gloo ranks (tests/harness.py), mock data, at EP2, EP4 and EP2 x expert-TP2 (TP2, sequence parallel),
   with both dispatchers (and alltoall padded to the capacity), against tests/moe_formulas.py (exact);
2. time: the step time of an MoE GPT (8 experts, top-2, expert hidden F) against the dense GPT with the
   same active parameters (MLP hidden 2F), one process, steps of both timed in alternating blocks;
3. grouped: one MoE layer's forward + backward with --moe-grouped-gemm (torch._grouped_mm) against the
   per-expert loop, at a few shapes, same weights and input; the largest output/gradient difference.

    OMP_NUM_THREADS=1 python bench/bench_moe.py            # a few minutes on 2 cores; --only bytes|time|grouped
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.config import validate  # noqa: E402
from megalite.config.arguments import MegaliteConfig  # noqa: E402
from megalite.moe.layer import MoELayer  # noqa: E402
from megalite.parallel.groups import ProcessGroups  # noqa: E402
from megalite.parallel.layout import RankLayout  # noqa: E402
from megalite.tensor_parallel.context import BuildContext  # noqa: E402
from megalite.tensor_parallel.random import RNGTracker  # noqa: E402
from megalite.training.loop import pretrain  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.moe_bytes_run import ITERS, MBS, MODEL, MOE, MOE_LABELS, SEQ, VOCAB, M, bytes_cfg, formula  # noqa: E402
from tests.tp_utils import mock_data  # noqa: E402

# (name, world, tp, ep, etp, extra flags)
LAYOUTS = [("EP2", 2, 1, 2, 1), ("EP4", 4, 1, 4, 1), ("EP2 x ETP2, TP2 SP", 4, 2, 2, 2)]
QUIET = lambda s: None  # noqa: E731


def runs() -> list[tuple[str, int, int, int, int, str, bool]]:
    out = []
    for name, world, tp, ep, etp in LAYOUTS:
        for disp, pad in (("alltoall", False), ("alltoall", True), ("allgather", False)):
            out.append((name, world, tp, ep, etp, disp, pad))
    return out


def _bytes_worker(rank: int, world: int) -> dict:
    out = {}
    for key in runs():
        name, w, tp, ep, etp, disp, pad = key
        if w != world:
            continue
        pg = ProcessGroups.build(RankLayout(world, tp, ep=ep, etp=etp), rank)
        pretrain(bytes_cfg(world, tp, ep, etp, disp, pad), pg, data=mock_data(VOCAB, SEQ, 1234, 64), log=QUIET)
        out[key] = Counter({k: v // ITERS for k, v in pg.comm_bytes.items() if k[1] in MOE_LABELS})
    return out


def bench_bytes() -> None:
    print(f"## MoE dispatch bytes per step ({MODEL['num_layers']} MoE layers, h {MODEL['hidden_size']}, "
          f"E {MOE['num_experts']}, k {MOE['moe_router_topk']}, seq {SEQ}, micro-batch {MBS}, {M} micro-batches "
          f"per rank, fp32), all ranks summed")
    res: dict = {}
    for world in sorted({r[1] for r in runs()}):
        for rank_out in [run_ranks(_bytes_worker, world, timeout=1200)]:
            for key in rank_out[0]:
                res[key] = [r[key] for r in rank_out]
    print("| layout | dispatcher | (group, label) | measured, all ranks | formula | per rank |")
    print("|---|---|---|---|---|---|")
    for key in runs():
        want, even = formula(key)
        ranks = res[key]
        got = sum(ranks, Counter())
        disp = key[5] + (" padded to capacity" if key[6] else "")
        for k in sorted(set(want) | set(got)):
            ok = "exact" if got[k] == want[k] else "MISMATCH"
            per = sorted({r[k] for r in ranks})
            if even:
                per_txt = "each " + f"{per[0]:,}" if len(per) == 1 else f"differ {per}"
                ok += "" if per == [want[k] // key[1]] else " (per rank MISMATCH)"
            else:
                per_txt = f"{per[0]:,} .. {per[-1]:,}"
            print(f"| {key[0]} | {disp} | {k[0]}, {k[1]} | {got[k]:,} | {want[k]:,} ({ok}) | {per_txt} |")


# ---- 2. MoE vs dense step time ---------------------------------------------------------------------------

STEP_MODEL = dict(MODEL, num_layers=4, hidden_size=128, num_attention_heads=4)
STEP_F = 256  # expert hidden size; the dense MLP has 2F (the active parameters of top-2)


STEP_KINDS = ("dense", "moe", "moe grouped")


def time_cfg(kind: str, iters: int, seq: int, mbs: int) -> MegaliteConfig:
    extra = dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=STEP_F, moe_aux_loss_coeff=0.01,
                 ffn_hidden_size=2 * STEP_F, moe_grouped_gemm=kind == "moe grouped") if kind != "dense" \
        else dict(ffn_hidden_size=2 * STEP_F)
    cfg = MegaliteConfig.from_flat(dict(
        STEP_MODEL, **extra, seq_length=seq, max_position_embeddings=seq, micro_batch_size=mbs,
        global_batch_size=mbs, train_iters=iters, lr=1e-4, log_interval=1, eval_iters=0, eval_interval=10_000,
        mock_data=True, vocab_size=VOCAB, seed=1234))
    validate(cfg, 1)
    return cfg


def step_times(cfg: MegaliteConfig, skip: int) -> list[float]:
    """Per-iteration wall times (ms) from the log lines, the first ``skip`` left out (warm-up)."""
    lines: list[str] = []
    pretrain(cfg, ProcessGroups.single(), data=mock_data(VOCAB, cfg.model.seq_length, 1234, 256), log=lines.append)
    ms = [float(m.group(1)) for line in lines if (m := re.search(r"elapsed time per iteration \(ms\): ([\d.]+)", line))]
    return ms[skip:]


def count_params(cfg: MegaliteConfig) -> tuple[int, int]:
    """(total, active per token) parameters of the transformer layers' MLPs."""
    m, h = cfg.model, cfg.model.hidden_size
    if m.is_moe:
        per_expert = 3 * h * m.expert_ffn_hidden_size  # swiglu: gate, up, down
        return m.num_layers * (m.num_experts * per_expert + m.num_experts * h), \
            m.num_layers * (m.moe_router_topk * per_expert + m.num_experts * h)
    per = 3 * h * m.ffn_hidden_size
    return m.num_layers * per, m.num_layers * per


def bench_time(args) -> None:
    seq, mbs, iters, skip = 128, 4, args.steps + 2, 2
    print(f"\n## step time, MoE (8 experts, top-2, F {STEP_F}) vs dense (MLP {2 * STEP_F}), {STEP_MODEL['num_layers']} "
          f"layers, h {STEP_MODEL['hidden_size']}, seq {seq}, micro-batch {mbs}, fp32, 1 process; "
          f"{args.rounds} alternating blocks of {args.steps} steps")
    times: dict[str, list[float]] = {k: [] for k in STEP_KINDS}
    for r in range(args.rounds):
        for name in (STEP_KINDS if r % 2 == 0 else STEP_KINDS[::-1]):
            times[name] += step_times(time_cfg(name, iters, seq, mbs), skip)
    med = {k: statistics.median(v) for k, v in times.items()}
    print("| model | MLP params (total) | active per token | median step (ms) | / dense |")
    print("|---|---|---|---|---|")
    for name in STEP_KINDS:
        total, active = count_params(time_cfg(name, 1, seq, mbs))
        print(f"| {name} | {total:,} | {active:,} | {med[name]:.1f} | {med[name] / med['dense']:.3f} |")


# ---- 3. grouped GEMM vs the per-expert loop ------------------------------------------------------------------

def layer_cfg(h: int, F: int, E: int, k: int, grouped: bool):
    cfg = MegaliteConfig.from_flat(dict(
        MODEL, hidden_size=h, num_attention_heads=4, num_experts=E, moe_router_topk=k, moe_ffn_hidden_size=F,
        moe_grouped_gemm=grouped, seq_length=SEQ, max_position_embeddings=SEQ, micro_batch_size=1,
        global_batch_size=1, train_iters=1, lr=1e-4, mock_data=True, vocab_size=VOCAB))
    return cfg.model


def make_layer(h: int, F: int, E: int, k: int, grouped: bool) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(layer_cfg(h, F, E, k, grouped), BuildContext(ProcessGroups.single(), RNGTracker()), 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    return layer


def fwd_bwd(layer: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    out = layer(x)
    out.square().sum().backward()
    return out.detach(), [x.grad] + [p.grad for p in layer.parameters() if p.grad is not None]


def timed(layer: MoELayer, x: torch.Tensor, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fwd_bwd(layer, x)
    return (time.perf_counter() - t0) / reps * 1e3


def bench_grouped(args) -> None:
    shapes = [(256, 64, 128, 8, 2), (256, 128, 256, 8, 2), (512, 256, 512, 16, 2), (1024, 256, 512, 64, 8)]
    print(f"\n## one MoE layer's forward + backward: --moe-grouped-gemm (torch._grouped_mm) vs the per-expert loop, "
          f"fp32, 1 thread; median of {args.rounds} alternating blocks")
    print("| tokens | h | F | E | k | loop (ms) | grouped (ms) | grouped / loop | max abs diff (out, grads) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T, h, F, E, k in shapes:
        loop, grouped = make_layer(h, F, E, k, False), make_layer(h, F, E, k, True)
        x = torch.randn(T, 1, h, generator=torch.Generator().manual_seed(1))
        a, b = fwd_bwd(loop, x), fwd_bwd(grouped, x)
        diff = max([float((a[0] - b[0]).abs().max())] + [float((g - q).abs().max()) for g, q in zip(a[1], b[1])])
        reps = max(2, int(2e6 // (T * h * F * k)))
        t = {"loop": [], "grouped": []}
        for r in range(args.rounds):
            for name, layer in ((("loop", loop), ("grouped", grouped)) if r % 2 == 0 else
                                (("grouped", grouped), ("loop", loop))):
                t[name].append(timed(layer, x, reps))
        ml, mg = statistics.median(t["loop"]), statistics.median(t["grouped"])
        print(f"| {T} | {h} | {F} | {E} | {k} | {ml:.2f} | {mg:.2f} | {mg / ml:.3f} | {diff:.2e} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["bytes", "time", "grouped"], help="run one part")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per block (time)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.only in (None, "bytes"):
        bench_bytes()
    if args.only in (None, "time"):
        bench_time(args)
    if args.only in (None, "grouped"):
        bench_grouped(args)


if __name__ == "__main__":
    main()
