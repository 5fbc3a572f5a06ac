"""The bytes one deferred W keeps, counted from the split backward's store and by the formula
(``megalite/planning/zero_bubble.py:deferred_w_bytes``, docs/design.md §3.4): shared by
tests/test_split_backward.py and bench/split_backward_memory.py (which adds the CPU allocator's view)."""

from __future__ import annotations

import torch

from megalite.config.model import ModelConfig
from megalite.parallel.groups import ProcessGroups
from megalite.planning.zero_bubble import deferred_w_bytes
from megalite.tensor_parallel.weight_grad import WeightGradStore


def build_model(cfg: ModelConfig, pg: ProcessGroups, vocab: int) -> tuple[torch.nn.Module, bool]:
    """The GPT of ``cfg`` on ``pg``, initialised; sequence parallel where TP > 1 allows it. -> (model, sp)"""
    from megalite.model.gpt import GPTModel
    from megalite.tensor_parallel.context import BuildContext
    from megalite.tensor_parallel.init import initialize_parameters
    from megalite.tensor_parallel.random import model_parallel_seed

    sp = pg.tp_size > 1 and cfg.num_attention_heads % pg.tp_size == 0
    model = GPTModel(cfg, BuildContext(pg, model_parallel_seed(1, pg.tp_rank, 0), sequence_parallel=sp), vocab)
    initialize_parameters(model, pg, 1, cfg.init_method_std, cfg.num_layers)
    return model, sp


def one_step(model: torch.nn.Module, tokens: torch.Tensor, store: WeightGradStore | None) -> None:
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
    model, sp = build_model(cfg, pg, vocab)
    tokens = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(0))
    store = WeightGradStore()
    one_step(model, tokens, store)
    formula = deferred_w_bytes(cfg, cfg.num_layers, s * b, model.padded_vocab, pg.tp_size, sp,
                               moe_layers=sum(cfg.moe_layers()), embedding=True)
    return store.pending_bytes(), formula


def measure_on_rank(rank: int, world: int, flat: dict, s: int, b: int, vocab: int) -> tuple[int, int]:
    """``measure`` on this rank of ``world`` TP ranks (a ``run_ranks`` worker; ``flat``: the ModelConfig)."""
    from megalite.parallel.layout import RankLayout

    return measure(ModelConfig(**flat), ProcessGroups.build(RankLayout(world, world, 1), rank), s, b, vocab)
