"""Bytes a zero-bubble schedule keeps for one deferred W, by formula and measured (docs/design.md §3.4).

Between a micro-batch's B and its W the split backward keeps, for every GEMM whose weight gradient W
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
from megalite.planning.zero_bubble import (  # the formula (docs/design.md §3.4), shared with the planner
    deferred_w_bytes,
)
from megalite.tensor_parallel.weight_grad import WeightGradStore


def _model(cfg: ModelConfig, pg: ProcessGroups, vocab: int) -> tuple[torch.nn.Module, bool]:
    from megalite.model.gpt import GPTModel
    from megalite.tensor_parallel.context import BuildContext
    from megalite.tensor_parallel.init import initialize_parameters
    from megalite.tensor_parallel.random import model_parallel_seed

    sp = pg.tp_size > 1 and cfg.num_attention_heads % pg.tp_size == 0
    model = GPTModel(cfg, BuildContext(pg, model_parallel_seed(1, pg.tp_rank, 0), sequence_parallel=sp), vocab)
    initialize_parameters(model, pg, 1, cfg.init_method_std, cfg.num_layers)
    return model, sp


def _step(model: torch.nn.Module, tokens: torch.Tensor, store: WeightGradStore | None) -> None:
    """Forward and backward (B only, with a store); the graph is gone when it returns."""
    if store is None:
        model(tokens, labels=tokens).float().mean().backward()
        return
    with store.deferrable():
        loss = model(tokens, labels=tokens).float().mean()
    with store.collect((0, 0)):
        loss.backward()


def measure(cfg: ModelConfig, pg: ProcessGroups, s: int, b: int, vocab: int) -> tuple[int, int]:
    """(bytes the store holds after one B of the whole model, the formula's) on ``pg``."""
    model, sp = _model(cfg, pg, vocab)
    tokens = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(0))
    store = WeightGradStore()
    _step(model, tokens, store)
    formula = deferred_w_bytes(cfg, cfg.num_layers, s * b, model.padded_vocab, pg.tp_size, sp,
                               moe_layers=sum(cfg.moe_layers()))
    return store.pending_bytes(), formula


def allocator_bytes(cfg: ModelConfig, s: int, b: int, vocab: int) -> int:
    """The same bytes from the CPU allocator (one rank): live after B minus live after a whole backward,
    plus the deferred weight gradients the whole backward holds and B not yet."""
    from bench import peak_memory

    model, _ = _model(cfg, ProcessGroups.single(), vocab)
    tokens = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(0))
    held = {}
    for split in (False, True):
        model.zero_grad(set_to_none=True)
        store = WeightGradStore() if split else None
        with peak_memory.measure() as rep:
            peak_memory.labelled(_step)(model, tokens, store)
        held[split] = rep.held
        deferred = store.deferred.get(0, set()) if store is not None else set()
    grads = sum(p.numel() * p.element_size() for p in deferred)
    return held[True] - held[False] + grads


def _rank(rank: int, world: int, flat: dict, s: int, b: int, vocab: int) -> tuple[int, int]:
    from megalite.parallel.layout import RankLayout

    return measure(ModelConfig(**flat), ProcessGroups.build(RankLayout(world, world, 1), rank), s, b, vocab)


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

            got, want = run_ranks(_rank, args.tp, flat, s, b, args.vocab)[0]
        name = "fused output + CE" if fused else "unfused output"
        alloc = f", allocator {allocator_bytes(ModelConfig(**flat), s, b, args.vocab) / 2**20:.2f} MiB" \
            if args.tp == 1 else ""
        print(f"tp={args.tp}{' +SP' if args.tp > 1 else ''} {name}: one pending W keeps {got / 2**20:.2f} MiB "
              f"(formula {want / 2**20:.2f} MiB, ratio {got / want:.4f}{alloc})")


if __name__ == "__main__":
    main()
