"""Bytes a zero-bubble schedule keeps for one deferred W, by formula and measured (docs/design.md §3.4).

The store's count and the formula: tests/split_backward_counts.py (shared with the test). Between a
micro-batch's B and its W the split backward keeps, for every GEMM whose weight gradient W
computes, its input and its output gradient; everything else of that micro-batch is freed by B as in an
unsplit backward. So ZB-H1's activations in flight are 1F1B's (p − r micro-batches on rank r), plus, at
the moment after a B, r + 1 micro-batches' worth of these bytes (rank r defers r W's). ZB-V's pending W's
are of both chunks of a rank, which keep different bytes (rank 0's chunk 1 holds the output layer), so its
peak is the table played with each W's own chunk's bytes (``peak_table_bytes``).

  python bench/split_backward_memory.py            # the formula against the store's count, one rank
  python bench/split_backward_memory.py --tp 2     # on 2 ranks with TP2 + sequence parallelism
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from megalite.config.model import ModelConfig
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.weight_grad import WeightGradStore
from tests.split_backward_counts import build_model, measure, measure_on_rank, one_step


def allocator_bytes(cfg: ModelConfig, s: int, b: int, vocab: int) -> int:
    """The same bytes from the CPU allocator (one rank): live after B minus live after a whole backward,
    plus the deferred weight gradients the whole backward holds and B not yet."""
    from bench import peak_memory

    model, _ = build_model(cfg, ProcessGroups.single(), vocab)
    tokens = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(0))
    held = {}
    for split in (False, True):
        model.zero_grad(set_to_none=True)
        store = WeightGradStore() if split else None
        with peak_memory.measure() as rep:
            peak_memory.labelled(one_step)(model, tokens, store)
        held[split] = rep.held
        deferred = store.queued() if store is not None else set()  # the output layer's (run after B) too
    grads = sum(p.numel() * p.element_size() for p in deferred)
    return held[True] - held[False] + grads


MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=8, group_query_attention=True, num_query_groups=2,
             seq_length=512, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             untie_embeddings_and_output_weights=True, disable_bias_linear=True, hidden_dropout=0.0,
             attention_dropout=0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()
    s, b = MODEL["seq_length"], args.micro_batch_size
    for fused in (False, True):
        flat = {**MODEL, "cross_entropy_loss_fusion": fused}
        if args.tp == 1:
            got, want = measure(ModelConfig(**flat), ProcessGroups.single(), s, b, args.vocab)
        else:
            from tests.harness import run_ranks

            got, want = run_ranks(measure_on_rank, args.tp, flat, s, b, args.vocab)[0]
        name = "fused output + CE" if fused else "unfused output"
        alloc = f", allocator {allocator_bytes(ModelConfig(**flat), s, b, args.vocab) / 2**20:.2f} MiB" \
            if args.tp == 1 else ""
        print(f"tp={args.tp}{' +SP' if args.tp > 1 else ''} {name}: one pending W keeps {got / 2**20:.2f} MiB "
              f"(formula {want / 2**20:.2f} MiB, ratio {got / want:.4f}{alloc})")


if __name__ == "__main__":
    main()
