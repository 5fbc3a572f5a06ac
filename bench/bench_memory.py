"""Activation memory per transformer layer, measured (bytes autograd saves) against Korthikanti et al.'s
formula, and the step-time cost of each recomputation mode.

    python bench/bench_memory.py            # table for bench/README.md
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megalite.config.model import ModelConfig  # noqa: E402
from megalite.model.activation_memory import bytes_per_layer, formula_bytes  # noqa: E402
from megalite.parallel.groups import ProcessGroups  # noqa: E402
from megalite.parallel.layout import RankLayout  # noqa: E402

SHAPE = dict(num_layers=1, hidden_size=512, num_attention_heads=8, seq_length=512, hidden_dropout=0.1,
             attention_dropout=0.1)
MB, VOCAB = 2, 1000
ROWS = [  # (label, tp, sequence parallel, recompute granularity, attention backend)
    ("TP=1, unfused attention", 1, False, None, "unfused"),
    ("TP=1, selective recompute", 1, False, "selective", "unfused"),
    ("TP=1, full recompute", 1, False, "full", "unfused"),
    ("TP=2, unfused attention", 2, False, None, "unfused"),
    ("TP=2 + SP, unfused attention", 2, True, None, "unfused"),
    ("TP=2 + SP, selective recompute", 2, True, "selective", "unfused"),
    ("TP=1, SDPA (fused) attention", 1, False, None, "sdpa"),
]


def _rows(rank: int, world: int) -> list[tuple[str, float, float]]:
    out = []
    for label, tp, sp, gran, backend in ROWS:
        cfg = ModelConfig(**SHAPE, recompute_granularity=gran, attention_backend=backend)
        pg = ProcessGroups.single() if tp == 1 else ProcessGroups.build(RankLayout(world, tp), rank)
        measured = bytes_per_layer(cfg, pg, MB, VOCAB, sequence_parallel=sp, exclude_weights=True)
        out.append((label, measured, formula_bytes(cfg, MB, tp, sp)))
    return out


def step_times() -> list[tuple[str, float]]:
    from megalite.config.arguments import MegaliteConfig
    from megalite.training.loop import pretrain
    from tests.tp_utils import mock_data

    torch.set_num_threads(2)
    base = dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=256, micro_batch_size=4,
                global_batch_size=4, train_iters=6, lr=1e-3, log_interval=100, eval_iters=0, mock_data=True,
                vocab_size=VOCAB, hidden_dropout=0.1, attention_dropout=0.0)
    modes = {"none": {}, "selective": {"recompute_granularity": "selective"},
             "full uniform 1": {"recompute_granularity": "full", "recompute_num_layers": 1},
             "full block 2": {"recompute_granularity": "full", "recompute_method": "block",
                              "recompute_num_layers": 2}}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(3):  # interleave the modes so machine load affects all alike
        for name, kw in modes.items():
            cfg = MegaliteConfig.from_flat({**base, **kw})
            from megalite.config import validate

            validate(cfg, 1)
            data = mock_data(VOCAB, 256, 1, 64)
            t0 = time.perf_counter()
            pretrain(cfg, ProcessGroups.single(), data=data, log=lambda s: None)
            times[name].append(time.perf_counter() - t0)
    base_t = statistics.median(times["none"])
    return [(n, statistics.median(t) / base_t) for n, t in times.items()]


def main() -> None:
    from tests.harness import run_ranks

    rows = run_ranks(_rows, 2)[0]
    print(f"per-layer activations, bf16, s={SHAPE['seq_length']} b={MB} h={SHAPE['hidden_size']} "
          f"a={SHAPE['num_attention_heads']} (dropout on)")
    print("| layout | measured MB | formula MB | measured / formula |")
    print("|---|---|---|---|")
    for label, m, f in rows:
        print(f"| {label} | {m / 2**20:.2f} | {f / 2**20:.2f} | {m / f:.2f} |")
    print("\nstep time relative to no recomputation "
          "(4 layers, h=256, s=256, b=4, attention dropout 0, 2 threads, median of 3)")
    print("| recompute | step time ratio |")
    print("|---|---|")
    for name, r in step_times():
        print(f"| {name} | {r:.2f} |")


if __name__ == "__main__":
    main()
