"""What a checkpoint save costs the training loop, synchronous vs --async-save, in the same run.

One process trains a GPT-2 style model (fp32, Adam) on mock data for ``--iters`` steps, saving every
``--save-interval`` steps into ``--dir``; once with synchronous saves, once with --async-save, same model,
same data. The time of every step is the gap between consecutive iteration log lines (a save runs
after its step's line, so it lands in the next gap). Printed, medians over the saves:

- normal step: the median gap of steps with no save in them and no write in flight;
- stall per save: the gap of the step after a save minus the normal step (synchronous: the whole save;
  asynchronous: the checks, the staging folder and the host copy);
- step while a write runs (asynchronous): the gaps of the later steps until the save was committed, and
  how many steps the write overlapped (the step after the save is counted in the stall's gap);
- the stop itself as --async-save measures and logs it ("the step stopped X s to copy it").

Training uses ``--threads`` intra-op threads (default 1) and the writer thread is another, so on a
2-core machine the write has a core of its own, as a GPU run's host has while the device computes.

    python bench/bench_async_save.py                                 # ~0.2 GB checkpoint
    python bench/bench_async_save.py --hidden-size 768 --num-layers 8 --dir /data/tmp
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megalite.checkpointing.paths import iter_dirname  # noqa: E402
from megalite.config import validate  # noqa: E402
from megalite.config.arguments import MegaliteConfig  # noqa: E402
from megalite.parallel.groups import ProcessGroups  # noqa: E402
from megalite.training.loop import pretrain  # noqa: E402
from tests.tp_utils import mock_data  # noqa: E402


def make_cfg(a: argparse.Namespace, save: str, asynchronous: bool) -> MegaliteConfig:
    return MegaliteConfig.from_flat(dict(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.hidden_size // 64,
        seq_length=a.seq_length, micro_batch_size=1, global_batch_size=a.batch, train_iters=a.iters, lr=1e-4,
        log_interval=1, eval_iters=0, eval_interval=10**6, mock_data=True, vocab_size=a.vocab, hidden_dropout=0.0,
        attention_dropout=0.0, save=save, save_interval=a.save_interval, async_save=asynchronous,
        overwrite_checkpoint=True))


def _timed_run(a: argparse.Namespace, save: str, asynchronous: bool) -> tuple[list[float], dict[int, int], list]:
    """Per-step gaps (gaps[i]: from step i+1's log line to step i+2's), per save the number of iteration
    lines logged before its commit line, and the stops --async-save logged."""
    shutil.rmtree(save, ignore_errors=True)
    cfg = make_cfg(a, save, asynchronous)
    validate(cfg, 1)
    stamps: list[float] = []
    committed: dict[int, int] = {}
    stops: list[float] = []

    def log(line: str) -> None:
        if line.startswith(" [") and " iteration " in line:
            stamps.append(time.perf_counter())
        elif line.startswith(" saved checkpoint at iteration"):
            committed[int(line.split()[4])] = len(stamps)
        elif "the step stopped" in line:
            stops.append(float(line.split("the step stopped ")[1].split()[0]))

    data = mock_data(a.vocab, a.seq_length, 1234, a.iters * a.batch)
    pretrain(cfg, ProcessGroups.single(), data=data, log=log)
    return [b - s for s, b in zip(stamps, stamps[1:])], committed, stops


def summary(gaps: list[float], committed: dict[int, int], save_interval: int, iters: int) -> dict[str, float]:
    """Normal step, stall per save and (asynchronous) step time while writing, from one run's gaps."""
    saves = [k for k in range(save_interval, iters, save_interval)]  # the final save ends the run
    busy = set()
    for k in saves:
        busy.update(range(k, max(committed.get(k, k + 1), k + 1) + 1))  # gaps[k - 1]: step k -> k + 1
    normal = statistics.median(g for i, g in enumerate(gaps, start=1) if i not in busy and i > 1)
    stalls = [gaps[k - 1] - normal for k in saves]
    writing = [gaps[i - 1] for k in saves for i in range(k + 1, committed.get(k, k + 1) + 1) if i <= len(gaps)]
    spans = [committed.get(k, k) - k + 1 for k in saves]  # asynchronous: steps k + 1 ... up to the commit
    return {"normal": normal, "stall": statistics.median(stalls),
            "writing": statistics.median(writing) if writing else float("nan"),
            "spans": statistics.median(spans)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--iters", type=int, default=21)
    p.add_argument("--save-interval", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dir", default=None, help="where to save (default: a temporary folder)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    root = tempfile.mkdtemp(dir=a.dir, prefix="bench_async_save_")
    try:
        figures = {}
        for name, asynchronous in (("sync", False), ("async", True)):
            gaps, committed, stops = _timed_run(a, os.path.join(root, name), asynchronous)
            figures[name] = summary(gaps, committed, a.save_interval, a.iters)
            figures[name]["stop"] = statistics.median(stops) if stops else float("nan")
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(root, "sync",
                   iter_dirname(a.save_interval))) for f in fs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"checkpoint {size / 1e9:.3f} GB, {a.iters} steps, a save every {a.save_interval}, "
          f"{a.threads} training thread(s), load average {os.getloadavg()[0]:.1f}")
    s, y = figures["sync"], figures["async"]
    print(f"| | synchronous | --async-save |\n|---|---|---|\n"
          f"| normal step, s | {s['normal']:.3f} | {y['normal']:.3f} |\n"
          f"| stall of the step that saves, s | {s['stall']:.3f} | {y['stall']:.3f} |\n"
          f"| step while the write runs, s | — | {y['writing']:.3f} |\n"
          f"| steps the write overlapped | 0 | {y['spans']:.0f} |\n"
          f"| the stop as logged (checks, staging, host copy), s | — | {y['stop']:.3f} |")


if __name__ == "__main__":
    main()
