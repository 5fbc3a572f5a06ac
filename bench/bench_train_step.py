"""Single-rank training step: megalite's GPTModel against Hugging Face's GPT2LMHeadModel.

Both models have the same shape (GPT-2 style: learned positions, LayerNorm, exact GeLU, tied
embeddings), run in fp32 with dropout 0, and take the same step: forward with the mean token loss,
backward, AdamW (torch's foreach AdamW, weight decay on matrices only, built identically for both).
The two are timed in alternating blocks in one process, so a busy machine slows both alike; per-step
times are medians over all blocks. MFU uses one FLOP count for both
(megalite.planning.flops.training_flops) against the fp32 matmul peak, probed once per round of
blocks (median), so it is measured under the same load as the steps.

    python bench/bench_train_step.py                # eager
    python bench/bench_train_step.py --compile      # also torch.compile of each model
    python bench/bench_train_step.py --device cuda --dtype bf16   # on a GPU (pure bf16 on both sides)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.config.model import ModelConfig  # noqa: E402
from megalite.config.training import OptimizerConfig  # noqa: E402
from megalite.model.gpt import GPTModel  # noqa: E402
from megalite.parallel.groups import ProcessGroups  # noqa: E402
from megalite.planning.flops import training_flops  # noqa: E402
from megalite.tensor_parallel.context import BuildContext  # noqa: E402
from megalite.tensor_parallel.init import initialize_parameters  # noqa: E402
from megalite.tensor_parallel.random import model_parallel_seed  # noqa: E402

LAYERS, HIDDEN, HEADS, VOCAB, MICRO_BATCH, SEQ = 6, 384, 6, 8192, 8, 256
OPT = OptimizerConfig(lr=1e-4, weight_decay=0.01)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """torch's foreach AdamW (what megalite's optimizer runs on CPU), no decay on biases and norms.

    Built the same way for both models so that only the models differ; parameters stay in the
    benchmark's dtype (no fp32 main copy) on both sides."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim > 1], "weight_decay": OPT.weight_decay},
              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=OPT.lr, betas=(OPT.adam_beta1, OPT.adam_beta2), eps=OPT.adam_eps,
                             foreach=True)


def matmul_peak_gflops(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...] = (2048, 3072, 4096),
                       reps: int = 2) -> float:
    """Best GFLOP/s of large square matmuls (on CPU: on the current thread count)."""
    if device.type == "cuda":
        sizes, reps = (4096, 8192), 20  # one matmul is too short to time on a GPU
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        out = torch.empty(n, n, device=device, dtype=dtype)
        torch.mm(a, b, out=out)  # warm-up
        for _ in range(2):
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(reps if device.type == "cuda" else 1):
                torch.mm(a, b, out=out)
            synchronize(device)
            per = (time.perf_counter() - t0) / (reps if device.type == "cuda" else 1)
            best = max(best, 2 * n**3 / per / 1e9)
    return best


def megalite_step(compile_model: bool, device: torch.device, dtype: torch.dtype) -> Callable[[], None]:
    cfg = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ,
                      hidden_dropout=0.0, attention_dropout=0.0)
    pg = ProcessGroups.single()
    model = GPTModel(cfg, BuildContext(pg, model_parallel_seed(1234, 0, 0), dtype, device), VOCAB)
    initialize_parameters(model, pg, 1234, cfg.init_method_std, cfg.num_layers)
    model.train()
    opt = adamw(model)
    fwd = torch.compile(model) if compile_model else model
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g).to(device)
    mb = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(MICRO_BATCH, SEQ, device=device)}

    def step() -> None:
        per_token = fwd(mb["tokens"], labels=mb["labels"])  # [b, s]
        loss = (per_token.float() * mb["loss_mask"]).sum() / mb["loss_mask"].sum()  # the loop's lm loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def hf_step(compile_model: bool, device: torch.device, dtype: torch.dtype) -> Callable[[], None]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                     activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).to(device=device, dtype=dtype)
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    model.train()
    opt = adamw(model)
    fwd = torch.compile(model) if compile_model else model
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g).to(device)

    def step() -> None:
        loss = fwd(input_ids=tokens, labels=tokens).loss  # HF shifts the labels inside
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _busy_cpu_seconds() -> float | None:
    """CPU seconds all processes have run (Linux /proc/stat), or None where unavailable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class Contention:
    """Measures how much CPU other processes took while a block of ours ran (in cores)."""

    def __enter__(self) -> Contention:
        self.wall, self.ours, self.busy = time.perf_counter(), time.process_time(), _busy_cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self.wall
        busy = _busy_cpu_seconds()
        if busy is None or self.busy is None:
            self.others = 0.0
        else:
            self.others = max(busy - self.busy - (time.process_time() - self.ours), 0.0) / wall


def run(steps: dict[str, Callable[[], None]], warmup: int, rounds: int, max_rounds: int, per_block: int,
        quiet: float, device: torch.device, dtype: torch.dtype
        ) -> tuple[dict[str, list[float]], list[float], int, int]:
    """Rounds of one block of ``per_block`` steps per candidate (order reversed every other round), each
    opened by a matmul-peak probe so the peak is measured under the same load as its steps.

    A round counts only if other processes used less than ``quiet`` cores during each of its blocks;
    rounds run until ``rounds`` have counted or ``max_rounds`` were tried (then every round counts).
    Returns, per candidate, the mean step seconds of each counted round, their peaks, the number of
    rounds tried and of quiet rounds."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    kept: dict[str, list[float]] = {name: [] for name in steps}
    every: dict[str, list[float]] = {name: [] for name in steps}
    kept_peaks, every_peaks = [], []
    r = 0
    while r < max_rounds and len(kept_peaks) < rounds:
        with Contention() as c:
            peak = matmul_peak_gflops(device, dtype)
        others, this = [c.others], {}
        for name in (list(steps) if r % 2 == 0 else list(reversed(steps))):  # A B, B A, ...
            with Contention() as c:
                synchronize(device)
                t0 = time.perf_counter()
                for _ in range(per_block):
                    steps[name]()
                synchronize(device)
                this[name] = (time.perf_counter() - t0) / per_block
            others.append(c.others)
        for name, t in this.items():
            every[name].append(t)
        every_peaks.append(peak)
        if max(others) < quiet:
            for name, t in this.items():
                kept[name].append(t)
            kept_peaks.append(peak)
        r += 1
    if len(kept_peaks) < rounds:
        return every, every_peaks, r, len(kept_peaks)
    return kept, kept_peaks, r, len(kept_peaks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per candidate")
    ap.add_argument("--rounds", type=int, default=8, help="quiet rounds of alternating blocks to collect")
    ap.add_argument("--max-rounds", type=int, default=40, help="give up waiting for quiet rounds after this many")
    ap.add_argument("--quiet", type=float, default=0.15,
                    help="a round counts if other processes used fewer cores than this during each block")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per block")
    ap.add_argument("--compile", action="store_true", help="also measure torch.compile of each model")
    ap.add_argument("--device", default="cpu", help="cpu (the reference figures) or cuda")
    ap.add_argument("--dtype", default="fp32", choices=list(DTYPES),
                    help="parameter and activation dtype of both models (and of the matmul-peak probe)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]

    steps = {"HF eager": hf_step(False, device, dtype), "megalite eager": megalite_step(False, device, dtype)}
    if args.compile:
        steps |= {"HF compiled": hf_step(True, device, dtype), "megalite compiled": megalite_step(True, device, dtype)}
    times, peaks, tried, quiet = run(steps, args.warmup, args.rounds, args.max_rounds, args.steps, args.quiet,
                                     device, dtype)

    mcfg = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ)
    tokens = MICRO_BATCH * SEQ
    flops = training_flops(mcfg, VOCAB, SEQ, tokens)
    med = statistics.median
    base = times["HF eager"]
    where = (torch.cuda.get_device_name(device) if device.type == "cuda" else f"{args.threads} CPU threads")
    print(f"torch {torch.__version__}, {where}, {args.dtype}; {flops / 1e9:.1f} GFLOP per step "
          f"({MICRO_BATCH}x{SEQ} tokens); {args.steps} steps per block; {args.dtype} matmul peak "
          f"{med(peaks):.0f} GFLOP/s (median of rounds, max {max(peaks):.0f})")
    if quiet >= args.rounds:
        print(f"{quiet} of {tried} rounds were quiet (other processes < {args.quiet} cores) and are reported")
    else:
        print(f"all {tried} rounds reported: only {quiet} were quiet (other processes < {args.quiet} cores); "
              "a busy machine narrows the gap")
    print("medians over rounds; the ratio and MFU are taken per round (same load), then the median")
    print(f"{'':<18} {'ms/step':>8} {'tokens/s':>9} {'MFU':>6} {'vs HF eager':>12}")
    for name, t in times.items():
        mfu = med([flops / s / 1e9 / p for s, p in zip(t, peaks)])
        ratio = med([h / s for h, s in zip(base, t)])
        print(f"{name:<18} {med(t) * 1e3:8.1f} {tokens / med(t):9.0f} {mfu:6.1%} {ratio:11.2f}x")
    if args.compile:
        ratio = med([h / s for h, s in zip(times["HF compiled"], times["megalite compiled"])])
        print(f"megalite compiled vs HF compiled: {ratio:.2f}x")


if __name__ == "__main__":
    main()
