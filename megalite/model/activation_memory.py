"""Count the bytes autograd saves for backward, per transformer layer, and compare with the formula of
Korthikanti et al. (2022): s*b*h*(34 + 5*a*s/h) with 16-bit activations and 1-byte dropout masks;
divided by t with tensor + sequence parallelism; 34*s*b*h/t with selective recomputation.
"""

from __future__ import annotations

import dataclasses

import torch

from megalite.config.model import ModelConfig
from megalite.model.gpt import GPTModel
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.init import initialize_parameters
from megalite.tensor_parallel.random import model_parallel_seed


def saved_bytes(fn, *args, weights: torch.nn.Module | None = None) -> int:
    """Bytes of distinct storages autograd saves while running ``fn(*args)`` (parameters excluded; with
    ``weights``, every storage of its parameters too: a linear layer saves a transposed view of its
    weight, which shares the weight's storage and is no activation)."""
    seen: dict[int, int] = {}
    skip = {p.untyped_storage().data_ptr() for p in weights.parameters()} if weights is not None else set()

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if not isinstance(t, torch.nn.Parameter) and st.data_ptr() not in skip:
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    del out
    return sum(seen.values())


def bytes_per_layer(cfg: ModelConfig, pg: ProcessGroups, micro_batch: int, vocab: int, *,
                    sequence_parallel: bool = False, dtype: torch.dtype = torch.bfloat16,
                    exclude_weights: bool = False) -> float:
    """Saved bytes of one transformer layer: the difference between 2-layer and 1-layer models."""
    out = []
    for layers in (1, 2):
        c = dataclasses.replace(cfg, num_layers=layers)
        ctx = BuildContext(pg, model_parallel_seed(1, pg.tp_rank, pg.pp_rank), dtype,
                           sequence_parallel=sequence_parallel)
        model = GPTModel(c, ctx, vocab)
        initialize_parameters(model, pg, 1, c.init_method_std, layers)
        model.train()
        tokens = torch.randint(0, vocab, (micro_batch, c.seq_length), generator=torch.Generator().manual_seed(0))
        hidden = model.embedding(tokens).detach().requires_grad_()
        angles = model._rope(c.seq_length, hidden.device)
        out.append(saved_bytes(model._run_layers, hidden, angles, weights=model if exclude_weights else None))
    return float(out[1] - out[0])


def formula_bytes(cfg: ModelConfig, micro_batch: int, tp: int, sequence_parallel: bool) -> float:
    """Korthikanti et al.'s per-layer activation bytes for this config and granularity."""
    s, b, h, a = cfg.seq_length, micro_batch, cfg.hidden_size, cfg.num_attention_heads
    if cfg.recompute_granularity == "full":
        return 2.0 * s * b * h / (tp if sequence_parallel else 1)  # only the layer input is kept
    attn = 0.0 if cfg.recompute_granularity == "selective" else 5.0 * a * s / h
    if sequence_parallel:
        return s * b * h * (34.0 + attn) / tp
    return s * b * h * (10.0 + 24.0 / tp + attn / tp)
