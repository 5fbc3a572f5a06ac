"""The distributed optimizer's legacy-format state (``distrib_optim.pt``) by parameter name.

With ``--use-distributed-optimizer --ckpt-format torch``, Megatron-LM saves next to each model-parallel
rank's ``model_optim_rng.pt`` a ``distrib_optim.pt``: megatron-core's ``save_parameter_state``, gathered
over the DP ranks and written by DP rank 0, ``{'buckets_coalesced': True, gbuf: {(param dtype, grad
dtype): {'param', 'exp_avg', 'exp_avg_sq': one fp32 tensor, 'numel_unpadded': n}}}``: per gradient buffer,
its buckets' unpadded contents one after the other (the padding between buckets dropped). The rank file's
``optimizer`` keeps the rest (the param groups with the step, the grad scaler).

Only the buffer's total size is saved, so the layout is rebuilt from the rank's own state dict (its
parameters in registration order, their local shapes) and Megatron-LM's bucket rule as its args configure
it (megatron_buffer.py), and checked: the total must be the saved one, and each fp32 parameter must be the
saved weight (cast to its dtype). A state that does not fit (another layout, more buffers: mixed dtypes,
experts or interleaved model chunks, the chained optimizers of an MoE run, the per-bucket format of before
February 2024) is not read, and why is returned.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.megatron_buffer import Placed, bucket_sizes, group_steps, place_buffer
from megalite.checkpointing.megatron_legacy_optim import BUFFERS
from megalite.checkpointing.safe_pickle import UnsafePickleError, load_torch_file

FILE = "distrib_optim.pt"
FIELDS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "param": "main"}
EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"


def distrib_file(model_file: str) -> str:
    """Where Megatron-LM saves a rank's distributed-optimizer state: next to its ``model_optim_rng.pt``."""
    return os.path.join(os.path.dirname(model_file), FILE)


def is_distributed(model_files: list[str], args: Any) -> bool:
    """Whether the run saved its optimizer as the distributed one (its args say so, or a rank's file is there)."""
    return bool(getattr(args, "use_distributed_optimizer", False)) or any(
        os.path.isfile(distrib_file(f)) for f in model_files)


def bucket_size(args: Any, pp_rank: int, numel: int) -> int | None:
    """The bucket size Megatron-LM gives a stage's (first) model chunk: none without overlapped gradient
    reduction, on stages after the first, or with the parameter gather overlapped with the step; else
    ``--ddp-bucket-size``, the parameters over ``--ddp-num-buckets``, or max(4e7, 1e6 x DP x CP)."""
    if not getattr(args, "overlap_grad_reduce", False) or pp_rank > 0 or \
            getattr(args, "overlap_param_gather_with_optimizer_step", False):
        return None
    if getattr(args, "ddp_num_buckets", None):
        return numel // int(args.ddp_num_buckets)
    if getattr(args, "ddp_bucket_size", None):
        return int(args.ddp_bucket_size)
    dp = int(getattr(args, "data_parallel_size", 1) or 1) * int(getattr(args, "context_parallel_size", 1) or 1)
    return max(40_000_000, 1_000_000 * dp)


def _buffer(path: str) -> dict[str, Any] | str:
    """The one gradient buffer's fields of a ``distrib_optim.pt``, or why it is not read."""
    if not os.path.isfile(path):
        return f"{path} is missing (the distributed optimizer's state of this rank)"
    try:
        state = load_torch_file(path)
    except UnsafePickleError:
        raise
    except CheckpointError as e:
        return str(e)
    if isinstance(state, list):
        return f"{path}: holds {len(state)} optimizers' states (the chained dense and expert optimizers of an MoE run)"
    if not isinstance(state, dict) or not state.get("buckets_coalesced"):
        return (f"{path}: not megatron-core's coalesced-bucket format (a per-bucket state saved before February "
                "2024; Megatron-LM's --ckpt-convert-update-legacy-dist-opt-format converts it)")
    buffers = [v for k, v in state.items() if k != "buckets_coalesced"]
    if len(buffers) != 1 or not isinstance(buffers[0], dict) or len(buffers[0]) != 1:
        return f"{path}: holds {len(buffers)} gradient buffers (or dtypes); one is read (one dtype, no experts)"
    fields = next(iter(buffers[0].values()))
    n = fields.get("numel_unpadded") if isinstance(fields, dict) else None
    if not isinstance(n, int) or any(not isinstance(fields.get(f), torch.Tensor) or fields[f].shape != (n,)
                                     for f in FIELDS):
        return f"{path}: its buffer is not three flat tensors ({', '.join(FIELDS)}) of its numel_unpadded {n}"
    return fields


def _layout(chunk: dict[str, torch.Tensor], args: Any, stage: tuple[int, int]
            ) -> tuple[Placed, list[int], int | None] | str:
    """(name -> (bucket, start, shape), the bucket sizes, the bucket size) of one model chunk's buffer, by
    megatron-core's rule; with pipeline stages a tied embedding's copy (the first stage's embedding, the last
    one's output layer) is alone in its bucket."""
    pp_rank, pp = stage
    copies = {EMBEDDING, OUTPUT} & set(chunk)  # one of them on a first or last stage (both: one stage)
    tied = pp > 1 and not getattr(args, "untie_embeddings_and_output_weights", False)
    alone = copies if tied and len(copies) == 1 else set()
    order = [(name, tuple(t.shape)) for name, t in reversed(chunk.items())]
    size = bucket_size(args, pp_rank, sum(t.numel() for t in chunk.values()))
    sizes = bucket_sizes([(name, int(torch.Size(s).numel())) for name, s in order], size, alone)
    placed = place_buffer(order, sizes)
    return placed if isinstance(placed, str) else (placed, sizes, size)


def distrib_moments(path: str, saved: Any, chunks: list[dict[str, torch.Tensor]], args: Any,
                    stage: tuple[int, int]) -> tuple[list[dict[str, dict[str, torch.Tensor]]], float] | str:
    """Per model chunk: field (exp_avg, exp_avg_sq, main) -> parameter name -> this rank's tensor, and Adam's
    step, from the rank's ``distrib_optim.pt`` at ``path`` and its file's ``optimizer`` (``saved``); ``chunks``
    the rank's parameters (its state dict without buffers), ``stage`` its (PP rank, PP size). Or why not read."""
    if len(chunks) != 1:
        return f"{path}: {len(chunks)} interleaved model chunks (one buffer each) are not read"
    steps = group_steps(saved.get("optimizer") if isinstance(saved, dict) else None)
    if len(steps) != 1 or min(steps) < 0:
        return f"{path}: its rank file's optimizer param_groups hold no single step count ({sorted(steps)[:4]})"
    fields = _buffer(path)
    if isinstance(fields, str):
        return fields
    params = {k: t for k, t in chunks[0].items() if not BUFFERS.search(k)}
    got = _layout(params, args, stage)
    if isinstance(got, str):
        return f"{path}: {got}"
    placed, sizes, size = got
    if sum(sizes) != fields["numel_unpadded"]:
        return (f"{path}: its buffer holds {fields['numel_unpadded']} elements, megatron-core's layout of the rank's "
                f"parameters {sum(sizes)} ({len(sizes)} buckets of the args' bucket size {size}; layout not matched)")
    out: dict[str, dict[str, torch.Tensor]] = {}
    for field, ours in FIELDS.items():
        buckets = torch.split(fields[field], sizes)
        for name, (b, start, shape) in placed.items():
            out.setdefault(ours, {})[name] = buckets[b][start:start + int(torch.Size(shape).numel())].view(shape)
    for name, weight in params.items():
        if not torch.equal(out["main"][name].to(weight.dtype), weight):
            return f"{path}: its fp32 parameter of {name} is not the saved weight (megatron-core's layout not matched)"
    return [out], steps.pop()
