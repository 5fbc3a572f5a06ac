"""Aux-loss-free load balancing (--moe-router-enable-expert-bias) against a skewed router, on real text.

A small MoE GPT (8 experts, top-2, sigmoid scores, no load-balancing loss) trains on the embedded corpus
(the quickstart's data: the Python standard library's text, built once under --corpus) from the same
start with the expert bias at a few update rates, and without it. The start is skewed on purpose: after
initialisation the router rows of two experts get a large component along the mean direction of that
router's input (measured on one batch), so most tokens score those two experts highest. The log line's
"expert imbalance (max/mean)" (tokens per expert over the logging window, mean over the MoE layers) is
read every --log-every iterations and the curves are plotted.

    OMP_NUM_THREADS=1 python bench/moe_expert_bias.py      # ~2-3 min on 2 cores; --plot docs/moe_expert_bias.png
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import megalite.training.loop as loop  # noqa: E402
from megalite.config import parse_args, validate  # noqa: E402
from megalite.data.default_corpus import ensure_default_corpus  # noqa: E402
from megalite.moe.router import Router  # noqa: E402
from megalite.parallel.groups import ProcessGroups  # noqa: E402
from megalite.training.batches import build_run_data  # noqa: E402

FAVOURED = (0, 1)  # the experts the skewed router prefers
IMBALANCE = re.compile(r"iteration\s+(\d+)/.*expert imbalance \(max/mean\): ([\d.]+)")


def flags(paths: dict, iters: int, log_every: int, rate: float | None) -> list[str]:
    argv = ["--data-path", paths["data_path"], "--split", "98,2,0", "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", paths["vocab_file"], "--merge-file", paths["merge_file"],
            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "8", "--global-batch-size", "8",
            "--train-iters", str(iters), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "10",
            "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--seed", "1234", "--log-interval", str(log_every), "--eval-iters", "0", "--eval-interval", "100000",
            "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
            "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
            "--moe-router-score-function", "sigmoid", "--moe-router-load-balancing-type", "none"]
    if rate is not None:
        argv += ["--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", str(rate)]
    return argv


def skew_routers(chunks: list, tokens: torch.Tensor, strength: float) -> None:
    """Add to the favoured experts' router rows ``strength`` x the unit mean direction of each router's
    input, scaled so the favoured logits rise by ``strength`` on average over ``tokens``."""
    routers = [m for c in chunks for m in c.modules() if isinstance(m, Router)]
    seen: dict[Router, torch.Tensor] = {}
    hooks = [r.register_forward_pre_hook(lambda mod, args: seen.setdefault(mod, args[0].detach())) for r in routers]
    for c in chunks:
        c.eval()
    with torch.no_grad():
        chunks[0](tokens)
        for r in routers:
            x = seen[r].reshape(-1, seen[r].shape[-1]).float()
            u = x.mean(0)
            u = u / u.norm()
            mean_proj = float((x @ u).mean())
            r.weight[list(FAVOURED)] += (strength / mean_proj) * u.to(r.weight.dtype)
    for h in hooks:
        h.remove()


def run(argv: list[str], strength: float) -> list[tuple[int, float]]:
    cfg = parse_args(argv)
    validate(cfg, 1)
    pg = ProcessGroups.single()
    data = build_run_data(cfg, pg)
    probe = torch.stack([torch.as_tensor(data.train[i]["text"][:-1]) for i in range(8)])
    build = loop.build_model

    def skewed_build(*args, **kwargs):
        chunks = build(*args, **kwargs)
        skew_routers(chunks, probe, strength)
        return chunks

    lines: list[str] = []
    loop.build_model = skewed_build
    try:
        loop.pretrain(cfg, pg, data=data, log=lambda s: (lines.append(s), print(s, flush=True)))
    finally:
        loop.build_model = build
    return [(int(m.group(1)), float(m.group(2))) for line in lines if (m := IMBALANCE.search(line))]


def plot(curves: dict[str, list[tuple[int, float]]], path: str, threshold: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for name, pts in curves.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=name)
    ax.axhline(threshold, color="grey", linestyle="--", linewidth=1, label=f"{threshold}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("expert imbalance (max/mean tokens)")
    ax.set_title("Skewed router, 8 experts top-2, sigmoid scores")
    ax.set_ylim(bottom=1.0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", default="corpus", help="where the embedded corpus is (built there if missing)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--rates", type=float, nargs="+", default=[1e-3, 1e-2],
                    help="--moe-router-bias-update-rate of the biased runs (one run each)")
    ap.add_argument("--strength", type=float, default=4.0, help="mean logit added to the favoured experts")
    ap.add_argument("--plot", help="write the curves to this PNG (docs/moe_expert_bias.png)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    paths = ensure_default_corpus(args.corpus)
    curves, secs = {}, {}
    runs = [(f"expert bias, rate {r:g}", r) for r in args.rates] + [("no expert bias", None)]
    for name, rate in runs:
        t0 = time.perf_counter()
        curves[name] = run(flags(paths, args.iters, args.log_every, rate), args.strength)
        secs[name] = time.perf_counter() - t0
    names = list(curves)
    print(f"\n## expert imbalance (max/mean tokens per expert, mean over the 2 MoE layers), skew strength "
          f"{args.strength:g}")
    print("| iteration | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for i, (it, _) in enumerate(curves[names[0]]):
        print(f"| {it} | " + " | ".join(f"{curves[n][i][1]:.3f}" for n in names) + " |")
    for n in names:
        below = next((it for it, v in curves[n] if v < 1.2), None)
        print(f"{n}: first logged under 1.2 at iteration {below}, last {curves[n][-1][1]:.3f}, "
              f"{secs[n]:.0f} s")
    if args.plot:
        plot(curves, args.plot, 1.2)


if __name__ == "__main__":
    main()
