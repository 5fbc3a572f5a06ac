"""Single-rank training step: megalite's GPTModel against Hugging Face's GPT2LMHeadModel.

Both models have the same shape (GPT-2 style: learned positions, LayerNorm, exact GeLU, tied
embeddings), run in fp32 with dropout 0, and take the same step: forward with the loss, backward,
AdamW (weight decay on matrices only, foreach implementation). The two are timed in alternating blocks
in one process, so a busy machine slows both alike; per-step times are medians over all blocks.
MFU uses one FLOP count for both (megalite.training.flops.training_flops) against the fp32 matmul
peak measured at the start of the run.

    python bench/bench_train_step.py                # eager
    python bench/bench_train_step.py --compile      # also torch.compile of each model
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
from megalite.optimizer.adam import build_adam, param_groups  # noqa: E402
from megalite.parallel.groups import ProcessGroups  # noqa: E402
from megalite.tensor_parallel.init import initialize_parameters  # noqa: E402
from megalite.tensor_parallel.random import model_parallel_seed  # noqa: E402
from megalite.training.flops import training_flops  # noqa: E402

LAYERS, HIDDEN, HEADS, VOCAB, MICRO_BATCH, SEQ = 6, 384, 6, 8192, 8, 256
OPT = OptimizerConfig(lr=1e-4, weight_decay=0.01)


def matmul_peak_gflops(sizes: tuple[int, ...] = (1024, 2048, 3072), reps: int = 3) -> float:
    """Best fp32 GFLOP/s of square matmuls on the current thread count."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        out = torch.empty(n, n)
        torch.mm(a, b, out=out)  # warm-up
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            best = max(best, 2 * n**3 / (time.perf_counter() - t0) / 1e9)
    return best


def megalite_step(compile_model: bool) -> Callable[[], None]:
    cfg = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ,
                      hidden_dropout=0.0, attention_dropout=0.0)
    pg = ProcessGroups.single()
    model = GPTModel(cfg, pg, VOCAB, model_parallel_seed(1234, 0, 0))
    initialize_parameters(model, pg, 1234, cfg.init_method_std, cfg.num_layers)
    model.train()
    opt = build_adam([model], OPT)
    fwd = torch.compile(model) if compile_model else model
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
    mb = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(MICRO_BATCH, SEQ)}

    def step() -> None:
        per_token = fwd(mb["tokens"], labels=mb["labels"])  # [b, s]
        loss = (per_token * mb["loss_mask"]).sum() / mb["loss_mask"].sum()  # the training loop's lm loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def hf_step(compile_model: bool) -> Callable[[], None]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                     activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    model.train()
    opt = torch.optim.AdamW(param_groups([model], OPT.weight_decay), lr=OPT.lr,
                            betas=(OPT.adam_beta1, OPT.adam_beta2), eps=OPT.adam_eps, foreach=True)
    fwd = torch.compile(model) if compile_model else model
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)

    def step() -> None:
        loss = fwd(input_ids=tokens, labels=tokens).loss  # HF shifts the labels inside
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def run(steps: dict[str, Callable[[], None]], warmup: int, repeats: int, per_block: int) -> dict[str, list[float]]:
    """Alternate blocks of ``per_block`` timed steps of each candidate; return every step's seconds."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(repeats):
        order = list(steps) if r % 2 == 0 else list(reversed(steps))  # A B, B A, ...
        for name in order:
            for _ in range(per_block):
                t0 = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per candidate")
    ap.add_argument("--repeats", type=int, default=6, help="alternating A/B blocks")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per block")
    ap.add_argument("--compile", action="store_true", help="also measure torch.compile of each model")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    peak = matmul_peak_gflops()
    steps = {"HF eager": hf_step(False), "megalite eager": megalite_step(False)}
    if args.compile:
        steps |= {"HF compiled": hf_step(True), "megalite compiled": megalite_step(True)}
    times = run(steps, args.warmup, args.repeats, args.steps)
    peak = max(peak, matmul_peak_gflops())  # best of start and end

    mcfg = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ)
    tokens = MICRO_BATCH * SEQ
    flops = training_flops(mcfg, VOCAB, SEQ, tokens)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"torch {torch.__version__}, {args.threads} threads, fp32 matmul peak {peak:.0f} GFLOP/s, "
          f"{flops / 1e9:.1f} GFLOP per step ({tokens} tokens), "
          f"{args.repeats}x{args.steps} timed steps per candidate (medians)")
    print(f"{'':<18} {'ms/step':>8} {'tokens/s':>9} {'MFU':>6} {'vs HF eager':>12}")
    for name, s in med.items():
        mfu = flops / s / 1e9 / peak
        print(f"{name:<18} {s * 1e3:8.1f} {tokens / s:9.0f} {mfu:6.1%} {med['HF eager'] / s:11.2f}x")
    if args.compile:
        print(f"megalite compiled / HF compiled: {med['HF compiled'] / med['megalite compiled']:.2f}x")


if __name__ == "__main__":
    main()
