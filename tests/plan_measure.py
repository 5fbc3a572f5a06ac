"""Measure, on CPU, what the planner's memory terms predict: the bytes autograd saves per transformer layer
(parameter storages excluded, views of them included in that exclusion) and the bytes of parameters,
gradients and optimizer state a rank holds. Used by tests/test_planning.py."""

from __future__ import annotations

import torch

from megalite.config.model import ModelConfig
from megalite.model.gpt import GPTModel
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.init import initialize_parameters
from megalite.tensor_parallel.random import model_parallel_seed


def saved_activation_bytes(model: torch.nn.Module, fn, *args) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while running ``fn(*args)``.

    A weight's transposed view shares the weight's storage: it is a parameter, not an activation."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in param_ptrs:
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    del out
    return sum(seen.values())


def layer_activation_bytes(cfg: ModelConfig, pg: ProcessGroups, micro_batch: int, vocab: int, *,
                           sequence_parallel: bool = False, dtype: torch.dtype = torch.bfloat16) -> int:
    """Saved bytes of one transformer layer: a 2-layer model's layers minus a 1-layer model's."""
    out = []
    for layers in (1, 2):
        c = ModelConfig(**{**cfg.__dict__, "num_layers": layers})
        tracker = model_parallel_seed(1, pg.tp_rank, pg.pp_rank)
        model = GPTModel(c, pg, vocab, tracker, sequence_parallel=sequence_parallel, dtype=dtype)
        initialize_parameters(model, pg, 1, c.init_method_std, layers)
        model.train()
        tokens = torch.randint(0, vocab, (micro_batch, c.seq_length), generator=torch.Generator().manual_seed(0))
        hidden = model.embedding(tokens).detach().requires_grad_()
        angles = model._rope(c.seq_length, hidden.device)
        out.append(saved_activation_bytes(model, model._run_layers, hidden, angles))
    return out[1] - out[0]
