"""--cross-entropy-loss-fusion: the training step's peak memory and CPU step time, fused against unfused.

A single-rank GPT with GPT-2's vocabulary (50257, padded to 50304) and a small body, so that the output
layer and its [s*b, vocab] fp32 logits dominate, as they do for real vocabularies. fp32, dropout 0; each
step is forward with the token-mean loss, backward, AdamW (megalite's model, torch's foreach AdamW).

Peak memory: each candidate runs in a fresh process; after a warm-up step (Adam state allocated) the
process's peak resident set (VmHWM) is reset (/proc/self/clear_refs), one step runs, and the step's peak
is VmHWM minus the resident set before it. Step time: the candidates alternate in blocks in one
process, under bench_train_step.run's contention accounting; ratios are per round, then the median.

    python bench/bench_fused_cross_entropy.py                    # figures for bench/README.md
    python bench/bench_fused_cross_entropy.py --chunks 24 26     # fused with chunks of 2^24, 2^26 logits
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_train_step import adamw, run  # noqa: E402

from megalite.config.model import ModelConfig  # noqa: E402
from megalite.model.gpt import GPTModel  # noqa: E402
from megalite.parallel.groups import ProcessGroups  # noqa: E402
from megalite.tensor_parallel import fused_cross_entropy  # noqa: E402
from megalite.tensor_parallel.context import BuildContext  # noqa: E402
from megalite.tensor_parallel.init import initialize_parameters  # noqa: E402
from megalite.tensor_parallel.random import model_parallel_seed  # noqa: E402

LAYERS, HIDDEN, HEADS, VOCAB, MICRO_BATCH, SEQ = 2, 256, 4, 50257, 4, 1024


def make_step(fused: bool, chunk_log2: int | None = None) -> Callable[[], None]:
    cfg = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ,
                      hidden_dropout=0.0, attention_dropout=0.0, cross_entropy_loss_fusion=fused)
    pg = ProcessGroups.single()
    model = GPTModel(cfg, BuildContext(pg, model_parallel_seed(1234, 0, 0)), VOCAB)
    initialize_parameters(model, pg, 1234, cfg.init_method_std, cfg.num_layers)
    model.train()
    opt = adamw(model)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(MICRO_BATCH, SEQ)
    chunk = 1 << chunk_log2 if chunk_log2 else fused_cross_entropy.CHUNK_ELEMENTS

    def step() -> None:
        fused_cross_entropy.CHUNK_ELEMENTS = chunk
        per_token = model(tokens[:, :-1], labels=tokens[:, 1:])
        ((per_token * mask).sum() / mask.sum()).backward()  # the loop's lm loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure_memory(fused: bool, chunk_log2: int | None) -> dict[str, float]:
    """In this (fresh) process: the resident set before a step and the step's peak above it, in MB."""
    step = make_step(fused, chunk_log2)
    step()  # warm-up: Adam state, allocator pools
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (the peak resident set) to the current resident set
    before = _status_kb("VmRSS")
    step()
    return {"before_mb": before / 1024, "step_peak_mb": (_status_kb("VmHWM") - before) / 1024}


def memory_in_subprocess(fused: bool, chunk_log2: int | None, threads: int) -> dict[str, float]:
    args = [sys.executable, __file__, "--memory-child", "1" if fused else "0", "--threads", str(threads)]
    if chunk_log2:
        args += ["--chunks", str(chunk_log2)]
    out = subprocess.run(args, capture_output=True, text=True, check=True, env={**os.environ,
                         "OMP_NUM_THREADS": str(threads)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="quiet rounds of alternating blocks to collect")
    ap.add_argument("--max-rounds", type=int, default=12)
    ap.add_argument("--quiet", type=float, default=0.15)
    ap.add_argument("--chunks", type=int, nargs="*", default=[], help="log2 of the fp32 logits per chunk of the "
                    "fused runs (default: megalite's CHUNK_ELEMENTS; at least MIN_CHUNK_TOKENS tokens either way)")
    ap.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child is not None:
        print(json.dumps(measure_memory(args.memory_child == "1", args.chunks[0] if args.chunks else None)))
        return
    fused_runs = {f"fused 2^{c}" if c else "fused": c for c in (args.chunks or [None])}
    memory = {"unfused": memory_in_subprocess(False, None, args.threads)}
    memory |= {name: memory_in_subprocess(True, c, args.threads) for name, c in fused_runs.items()}
    steps = {"unfused": make_step(False)} | {name: make_step(True, c) for name, c in fused_runs.items()}
    times, _, tried, quiet = run(steps, 1, args.rounds, args.max_rounds, 1, args.quiet, torch.device("cpu"),
                                 torch.float32)
    med = statistics.median
    logits_mb = MICRO_BATCH * SEQ * 50304 * 4 / 2**20
    print(f"torch {torch.__version__}, {args.threads} CPU threads, fp32; {LAYERS} layers, h={HIDDEN}, "
          f"vocab {VOCAB}, {MICRO_BATCH}x{SEQ} tokens (full fp32 logits {logits_mb:.0f} MB); "
          f"{quiet} of {tried} rounds quiet (other processes < {args.quiet} cores)"
          + ("" if quiet >= args.rounds else ", all rounds reported"))
    print("| run | step peak MB (above resident) | vs unfused | resident before step MB | ms/step | "
          "step time vs unfused |")
    print("|---|---|---|---|---|---|")
    base_mem = memory["unfused"]["step_peak_mb"]
    for name, t in times.items():
        m = memory[name]
        ratio = med([s / b for s, b in zip(t, times["unfused"])])
        print(f"| {name} | {m['step_peak_mb']:.0f} | {m['step_peak_mb'] / base_mem:.2f} | {m['before_mb']:.0f} | "
              f"{med(t) * 1e3:.0f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
