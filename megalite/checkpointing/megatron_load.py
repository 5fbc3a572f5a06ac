"""``--load`` of a Megatron-LM checkpoint folder: its weights straight into this run's model, any layout.

Every rank reads the checkpoint as full tensors (megatron.py) and keeps its own shard of each
(``local_shard``), as the offline import would write them. Megatron's optimizer state is not read here
(``from-megatron`` imports it), so the run must say it starts a fresh optimizer (``--no-load-optim``
keeps the iteration and consumed samples, ``--finetune`` starts from 0); the model flags must describe
the checkpoint's model, each differing shape flag named.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.load import LoadedState, check_config
from megalite.checkpointing.megatron import read_megatron
from megalite.checkpointing.stored import named_params
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.param_meta import local_shard, param_meta


@torch.no_grad()
def load_megatron(load_dir: str, chunks: list[nn.Module], pg: ProcessGroups, model_config: dict[str, Any],
                  *, weights_only: bool) -> LoadedState:
    """Copy this rank's shards of the Megatron-LM checkpoint in ``load_dir`` into ``chunks``."""
    if not weights_only:
        raise CheckpointError(f"--load {load_dir} is a Megatron-LM checkpoint: its weights load here, its optimizer "
                              "state does not; pass --no-load-optim (keeps its iteration) or --finetune, or import "
                              "it with its Adam state: tools/convert_checkpoint.py from-megatron")
    src = read_megatron(load_dir, vocab_size=int(model_config["vocab_size"]))
    check_config(src.config, model_config, f"--load {load_dir} (Megatron-LM, {src.format})")
    for _, key, p in named_params(chunks):
        if key not in src.params:
            raise CheckpointError(f"--load {load_dir}: the Megatron-LM checkpoint has no {key}")
        local = local_shard(param_meta(p), src.params[key], pg)
        if local.numel() != p.numel():
            raise CheckpointError(f"--load {load_dir}: {key}: this rank's shard has {local.numel()} elements, "
                                  f"the parameter {p.numel()}")
        p.copy_(local.view(p.shape).to(p.dtype))
    return LoadedState(src.iteration, src.state, same_layout=False)
