"""Shared helpers for tests that compare a parallel layout with the single-process model."""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

from megalite.config.model import ModelConfig
from megalite.data.mock import MockGPTDataset
from megalite.model.gpt import GPTModel
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.init import initialize_parameters
from megalite.tensor_parallel.param_meta import param_meta
from megalite.tensor_parallel.random import model_parallel_seed
from megalite.training.batches import RunData

GPT2 = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, hidden_dropout=0.0,
            attention_dropout=0.0)
LLAMA_GQA = dict(num_layers=2, hidden_size=64, num_attention_heads=8, group_query_attention=True,
                 num_query_groups=2, seq_length=16, position_embedding_type="rope", normalization="RMSNorm",
                 swiglu=True, untie_embeddings_and_output_weights=True, disable_bias_linear=True,
                 hidden_dropout=0.0, attention_dropout=0.0)


def groups_for(world: int, rank: int, tp: int = 1, pp: int = 1) -> ProcessGroups:
    """ProcessGroups of a layout over the already-initialized world (single() for tp=pp=world=1)."""
    if tp == 1 and pp == 1 and world == 1:
        return ProcessGroups.single()
    return ProcessGroups.build(RankLayout(world, tp, pp), rank)


def build(cfg: ModelConfig, pg: ProcessGroups, vocab: int, seed: int = 1234) -> GPTModel:
    tracker = model_parallel_seed(seed, pg.tp_rank, pg.pp_rank)
    model = GPTModel(cfg, BuildContext(pg, tracker), vocab)
    initialize_parameters(model, pg, seed, cfg.init_method_std, cfg.num_layers)
    return model


def gather_full(param: torch.nn.Parameter, tensor: torch.Tensor, pg: ProcessGroups) -> torch.Tensor:
    """The full (layout-free) tensor of a parameter-shaped ``tensor`` sharded over TP."""
    if pg.tp_size == 1:
        return param_meta(param).spec.unshard([tensor])
    parts = [torch.empty_like(tensor) for _ in range(pg.tp_size)]
    dist.all_gather(parts, tensor.contiguous(), group=pg.groups["tp"])
    return param_meta(param).spec.unshard(parts)


def mock_data(vocab: int, seq: int, seed: int, n: int, documents: bool = False) -> RunData:
    """Mock train and valid data (EOD-terminated documents with ``documents``, as --mock-data with a
    packed-document flag)."""
    tok = types.SimpleNamespace(vocab_size=vocab, eod=vocab - 1)
    eod = tok.eod if documents else None
    return RunData(tok, MockGPTDataset(n, seq, vocab, seed, eod), MockGPTDataset(n, seq, vocab, seed + 1, eod), None)


def layout_flat(model: dict, *, vocab: int, iters: int, tp: int = 1, pp: int = 1, **extra) -> dict:
    """The flat flags of a short mock-data run of ``model`` at (tp, pp): micro-batch 1, global batch 4,
    seed 1234; ``extra`` adds flags or overrides these."""
    return {**model, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "micro_batch_size": 1,
            "global_batch_size": 4, "train_iters": iters, "lr": 3e-3, "lr_warmup_iters": 2, "log_interval": 5,
            "eval_iters": 0, "eval_interval": 1000, "mock_data": True, "vocab_size": vocab, "seed": 1234, **extra}


def layout_cfg(model: dict, *, vocab: int, iters: int, tp: int = 1, pp: int = 1, **extra):
    """``layout_flat`` as a config."""
    from megalite.config.arguments import MegaliteConfig

    return MegaliteConfig.from_flat(layout_flat(model, vocab=vocab, iters=iters, tp=tp, pp=pp, **extra))
