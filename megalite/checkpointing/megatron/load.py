"""``--load`` of a Megatron-LM checkpoint folder: its weights straight into this run's model, any layout.

Every rank reads the checkpoint as full tensors (read.py) and keeps its own shard of each
(``local_shard``), as the offline import would write them, and so does the Adam state read.py
reads (torch_dist's model-space state, the distributed optimizer's dp_reshardable buckets, the legacy
files' numbered one and their distrib_optim.pt); where the checkpoint holds none it reads, the run must
say it starts a fresh optimizer (``--no-load-optim`` keeps the iteration and consumed samples,
``--finetune`` starts from 0). Its RNG states are restored where the run has the layout they were saved
at (rng.py). The model flags must describe the checkpoint's model, each differing shape flag named.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.load import LoadedState, check_config, load_optimizer_state
from megalite.checkpointing.megatron.read import read_megatron
from megalite.checkpointing.megatron.rng import rng_to_restore
from megalite.checkpointing.stored import named_params
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.param_meta import local_shard, param_meta


@torch.no_grad()
def load_megatron(load_dir: str, chunks: list[nn.Module], pg: ProcessGroups, model_config: dict[str, Any],
                  *, weights_only: bool, optimizer: Any = None, rng_now: dict[str, torch.Tensor] | None = None
                  ) -> tuple[LoadedState, dict[str, torch.Tensor] | None, str]:
    """Copy this rank's shards of the Megatron-LM checkpoint in ``load_dir`` into ``chunks`` and, unless
    ``weights_only``, its Adam state into ``optimizer`` (refused, with the reason, when it holds none
    megalite reads); with ``rng_now`` (this run's RNG states), also the RNG states to restore and a note."""
    vocab = model_config.get("vocab_size")
    src = read_megatron(load_dir, vocab_size=None if vocab is None else int(vocab))
    if not weights_only and src.optimizer is None:
        raise CheckpointError(f"--load {load_dir} is a Megatron-LM checkpoint whose optimizer state does not load "
                              f"({src.optimizer_note}); pass --no-load-optim (keeps its iteration) or --finetune")
    check_config(src.config, model_config, f"--load {load_dir} (Megatron-LM, {src.format})")
    for _, key, p in named_params(chunks):
        p.copy_(_local(load_dir, src.params, key, p, pg).to(p.dtype))
    opt = src.optimizer_source()  # the import's rule for the main parameters, as from-megatron writes them
    if not weights_only and optimizer is not None and opt is not None:
        def shard(key: str, field: str, p: nn.Parameter) -> torch.Tensor:
            return _local(load_dir, {key: opt.get(key, field)}, key, p, pg)

        load_optimizer_state(chunks, optimizer, shard, opt.step)
    rng, note = (rng_to_restore(src.rng, src.rng_note, pg, rng_now) if rng_now is not None
                 else (None, "RNG states not loaded"))
    return LoadedState(src.iteration, src.state, same_layout=False), rng, note


def _local(load_dir: str, full: dict[str, torch.Tensor], key: str, p: nn.Parameter, pg: ProcessGroups) -> torch.Tensor:
    """This rank's shard of ``full[key]`` for parameter ``p``, shaped as it."""
    if key not in full:
        raise CheckpointError(f"--load {load_dir}: the Megatron-LM checkpoint has no {key}")
    local = local_shard(param_meta(p), full[key], pg)
    if local.numel() != p.numel():
        raise CheckpointError(f"--load {load_dir}: {key}: this rank's shard has {local.numel()} elements, "
                              f"the parameter {p.numel()}")
    return local.view(p.shape)
