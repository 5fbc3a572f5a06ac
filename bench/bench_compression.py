"""--grad-compression: DP bytes saved and loss cost, on the embedded corpus at DP 2.

Trains the same small GPT for --iters iterations with none / powersgd / int8 (2 ranks, same seed, same
data order), reports the DP gradient bytes each rank handed to collectives (pg.comm_bytes) and the loss
(mean of the last 20 iterations and the last one) against the uncompressed run, and plots the curves.

    OMP_NUM_THREADS=1 python bench/bench_compression.py          # figures and plot for bench/README.md
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.config import parse_args, validate  # noqa: E402
from megalite.data.default_corpus import ensure_default_corpus  # noqa: E402
from megalite.parallel.groups import ProcessGroups  # noqa: E402
from megalite.parallel.layout import RankLayout  # noqa: E402
from megalite.training.loop import pretrain  # noqa: E402
from tests.harness import run_ranks  # noqa: E402

RUNS = {"none": [], "powersgd r=4": ["--grad-compression", "powersgd", "--powersgd-rank", "4"],
        "int8": ["--grad-compression", "int8"]}


def flags(corpus: dict, iters: int) -> list[str]:
    return ["--data-path", corpus["data_path"], "--split", "98,2,0", "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", corpus["vocab_file"], "--merge-file", corpus["merge_file"],
            "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
            "--train-iters", str(iters), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "10",
            "--weight-decay", "0.1", "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--seed", "1234", "--log-interval", "50", "--eval-iters", "0", "--eval-interval", "100000",
            "--grad-compression-warmup-steps", "10"]


def _train(rank: int, world: int, argv: list[str]) -> dict:
    cfg = parse_args(argv)
    validate(cfg, world)
    pg = ProcessGroups.build(RankLayout(world), rank)
    res = pretrain(cfg, pg, log=lambda s: None)
    dp = sum(v for (kind, label), v in pg.comm_bytes.items() if kind == "dp" and label.startswith("grad"))
    return {"losses": res.losses, "dp_bytes": dp}


def plot(curves: dict[str, list[float]], path: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1.0)
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title("DP 2, embedded corpus: gradient compression")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--corpus", default="corpus")
    ap.add_argument("--plot", default="docs/grad_compression.png")
    args = ap.parse_args()
    corpus = ensure_default_corpus(args.corpus)
    out = {name: run_ranks(_train, 2, flags(corpus, args.iters) + extra, timeout=3600)[1]
           for name, extra in RUNS.items()}
    base = out["none"]
    print("| compression | DP bytes per rank | vs none | loss, mean of last 20 | vs none | final loss |")
    print("|---|---|---|---|---|---|")
    tail = lambda r: sum(r["losses"][-20:]) / 20  # noqa: E731
    for name, r in out.items():
        print(f"| {name} | {r['dp_bytes'] / 1e6:.1f} MB | {r['dp_bytes'] / base['dp_bytes']:.3f}x | "
              f"{tail(r):.4f} | {tail(r) - tail(base):+.4f} | {r['losses'][-1]:.4f} |")
    if plot({k: v["losses"] for k, v in out.items()}, args.plot):
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
