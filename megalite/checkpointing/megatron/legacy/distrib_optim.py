"""The distributed optimizer's legacy-format state (``distrib_optim.pt``) by parameter name.

With ``--use-distributed-optimizer --ckpt-format torch``, Megatron-LM saves next to each model-parallel
rank's ``model_optim_rng.pt`` a ``distrib_optim.pt``: megatron-core's ``save_parameter_state``, gathered
over the DP ranks and written by DP rank 0, ``{'buckets_coalesced': True, gbuf: {(param dtype, grad
dtype): {'param', 'exp_avg', 'exp_avg_sq': one fp32 tensor, 'numel_unpadded': n}}}``: per gradient buffer,
its buckets' unpadded contents one after the other (the padding between buckets dropped). The rank file's
``optimizer`` keeps the rest (the param groups with the step, the grad scaler).

gbuf c is model chunk c's buffer (``model0``, ``model1``, ... with interleaving: one DDP, so one buffer, per
chunk). An MoE run at EP > 1 has a ChainedOptimizer (dense and expert optimizers), which saves a list of
such states in the order of the rank file's ``optimizer`` list, None for an optimizer whose DP rank 0 is
another rank; the expert optimizer's buffers (one per chunk with experts) hold the rank's routed experts.

Only a buffer's total size is saved, so the layout is rebuilt from the rank's own state dict (its
parameters in registration order, their local shapes) and Megatron-LM's bucket rule as its args configure
it (buffer.py), and checked: the total must be the saved one, and each fp32 parameter must be the
saved weight (cast to its dtype). A state that does not fit (another layout, more buffers per chunk: mixed
dtypes, other chained optimizers, the per-bucket format of before February 2024) is not read, and why is
returned.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.megatron.buffer import (
    DENSE_OPTIMIZER,
    EP_OPTIMIZER,
    FIELDS,
    Placed,
    bucket_sizes,
    group_steps,
    main_mismatch,
    optimizer_kind,
    place_buffer,
)
from megalite.checkpointing.megatron.names import BUFFERS, EXPERT_KEY
from megalite.checkpointing.megatron.safe_pickle import UnsafePickleError, load_torch_file

FILE = "distrib_optim.pt"
EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"


def distrib_file(model_file: str) -> str:
    """Where Megatron-LM saves a rank's distributed-optimizer state: next to its ``model_optim_rng.pt``."""
    return os.path.join(os.path.dirname(model_file), FILE)


def is_distributed(model_files: list[str], args: Any) -> bool:
    """Whether the run saved its optimizer as the distributed one (its args say so, or a rank's file is there)."""
    return bool(getattr(args, "use_distributed_optimizer", False)) or any(
        os.path.isfile(distrib_file(f)) for f in model_files)


def bucket_size(args: Any, pp_rank: int, chunk: int, numel: int) -> int | None:
    """The bucket size Megatron-LM gives a rank's model chunk (``numel``: the rank's parameters, all chunks):
    none without overlapped gradient reduction, on stages after the first, on model chunks after the first
    (interleaving) or with the parameter gather overlapped with the step; else ``--ddp-bucket-size``, the
    parameters over ``--ddp-num-buckets``, or max(4e7, 1e6 x DP x CP)."""
    if not getattr(args, "overlap_grad_reduce", False) or pp_rank > 0 or chunk > 0 or \
            getattr(args, "overlap_param_gather_with_optimizer_step", False):
        return None
    if getattr(args, "ddp_num_buckets", None):
        return numel // int(args.ddp_num_buckets)
    if getattr(args, "ddp_bucket_size", None):
        return int(args.ddp_bucket_size)
    dp = int(getattr(args, "data_parallel_size", 1) or 1) * int(getattr(args, "context_parallel_size", 1) or 1)
    return max(40_000_000, 1_000_000 * dp)


def _states(path: str) -> list[dict[Any, Any] | None] | str:
    """Each optimizer's parameter state in a ``distrib_optim.pt``: the one's, or a ChainedOptimizer's list (an
    MoE run's dense and expert optimizers; None for one whose DP rank 0 is another rank); or why not read."""
    if not os.path.isfile(path):
        return f"{path} is missing (the distributed optimizer's state of this rank)"
    try:
        state = load_torch_file(path)
    except UnsafePickleError:
        raise
    except CheckpointError as e:
        return str(e)
    states = state if isinstance(state, list) else [state]
    if not states or any(s is not None and (not isinstance(s, dict) or not s.get("buckets_coalesced"))
                         for s in states):
        return (f"{path}: not megatron-core's coalesced-bucket format (a per-bucket state saved before February "
                "2024; Megatron-LM's --ckpt-convert-update-legacy-dist-opt-format converts it)")
    return states


def _buffers(path: str, state: dict[Any, Any], which: str) -> list[dict[str, Any]] | str:
    """The fields of one optimizer's gradient buffers, in order (gbuf 0, 1, ...: one per model chunk), each
    three flat fp32 tensors of its ``numel_unpadded``; or why not read."""
    keys = [k for k in state if k != "buckets_coalesced"]
    if set(keys) != set(range(len(keys))):
        return f"{path}: the {which} optimizer's gradient buffers {keys} are not numbered 0..n"
    out = []
    for k in range(len(keys)):
        per = state[k]
        if not isinstance(per, dict) or len(per) != 1:
            return f"{path}: the {which} optimizer's gradient buffer {k} is not of one dtype (one is read)"
        fields = next(iter(per.values()))
        n = fields.get("numel_unpadded") if isinstance(fields, dict) else None
        if not isinstance(n, int) or any(not isinstance(fields.get(f), torch.Tensor) or fields[f].shape != (n,)
                                         for f in FIELDS):
            return (f"{path}: the {which} optimizer's buffer {k} is not three flat tensors ({', '.join(FIELDS)}) "
                    f"of its numel_unpadded {n}")
        out.append(fields)
    return out


def _kinds(saved: list[Any], path: str) -> list[str] | str:
    """What each saved optimizer holds: 'all' (one optimizer), or a ChainedOptimizer's 'dense' and 'expert'
    (megatron_buffer.optimizer_kind)."""
    if len(saved) == 1:
        return ["all"]
    kinds = []
    for i, one in enumerate(saved):
        inner = one.get("optimizer") if isinstance(one, dict) else None
        groups = inner.get("param_groups") if isinstance(inner, dict) else None
        kind = optimizer_kind(groups, i)
        if kind is None:
            return f"{path}: its rank file's optimizer {i} holds no param groups all dense or all expert"
        kinds.append(kind)
    if sorted(kinds) != sorted([DENSE_OPTIMIZER, EP_OPTIMIZER]):
        return (f"{path}: its rank file's chained optimizers are {kinds}; one dense and one expert optimizer are "
                "read (not --overlap-param-gather-with-optimizer-step's one per model chunk)")
    return kinds


def _held(params: list[dict[str, torch.Tensor]], kind: str) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """(chunk, its parameters) of each model chunk with parameters in an optimizer of ``kind``: its buffers
    (megatron-core's DDP keeps the routed experts of an EP run in buffers of their own)."""
    out = []
    for c, chunk in enumerate(params):
        mine = {k: t for k, t in chunk.items() if kind == "all" or (kind == EP_OPTIMIZER) == bool(EXPERT_KEY.search(k))}
        if mine:
            out.append((c, mine))
    return out


def _layout(chunk: dict[str, torch.Tensor], args: Any, stage: tuple[int, int], c: int, numel: int
            ) -> tuple[Placed, list[int], int | None] | str:
    """(name -> (bucket, start, shape), the bucket sizes, the bucket size) of model chunk ``c``'s buffer, by
    megatron-core's rule (bucketed on the first stage's first chunk only; ``numel`` the rank's parameters); with
    pipeline stages a tied embedding's copy (the first stage's embedding, the last one's output layer) is
    alone in its bucket."""
    pp_rank, pp = stage
    copies = {EMBEDDING, OUTPUT} & set(chunk)  # one of them on a first or last stage (both: one stage)
    tied = pp > 1 and not getattr(args, "untie_embeddings_and_output_weights", False)
    alone = copies if tied and len(copies) == 1 else set()
    order = [(name, tuple(t.shape)) for name, t in reversed(chunk.items())]
    size = bucket_size(args, pp_rank, c, numel)
    sizes = bucket_sizes([(name, int(torch.Size(s).numel())) for name, s in order], size, alone)
    placed = place_buffer(order, sizes)
    return placed if isinstance(placed, str) else (placed, sizes, size)


def _read_buffer(path: str, fields: dict[str, Any], params: dict[str, torch.Tensor], args: Any,
                 where: tuple[tuple[int, int], int, int]) -> dict[str, dict[str, torch.Tensor]] | str:
    """field -> name -> this rank's tensor from one buffer holding ``params`` (``where``: the stage, the model
    chunk, the rank's parameter count); the layout must add up to the saved total and give every fp32
    parameter equal to its saved weight."""
    stage, c, numel = where
    got = _layout(params, args, stage, c, numel)
    if isinstance(got, str):
        return f"{path}: {got}"
    placed, sizes, size = got
    if sum(sizes) != fields["numel_unpadded"]:
        return (f"{path}: its buffer of model chunk {c} holds {fields['numel_unpadded']} elements, megatron-core's "
                f"layout of the rank's parameters {sum(sizes)} ({len(sizes)} buckets of the args' bucket size "
                f"{size}; layout not matched)")
    out: dict[str, dict[str, torch.Tensor]] = {}
    for field, ours in FIELDS.items():
        buckets = torch.split(fields[field], sizes)
        for name, (b, start, shape) in placed.items():
            out.setdefault(ours, {})[name] = buckets[b][start:start + int(torch.Size(shape).numel())].view(shape)
    wrong = main_mismatch(out["main"], params)
    return f"{path}: {wrong} (megatron-core's layout not matched)" if wrong else out


def _saved_step(saved: list[Any], path: str) -> float | str:
    """Adam's one step count over the saved optimizers' param groups (dense and expert alike)."""
    steps = set().union(*(group_steps(s.get("optimizer") if isinstance(s, dict) else None) for s in saved))
    if len(steps) != 1 or min(steps) < 0:
        return f"{path}: its rank file's optimizer param_groups hold no single step count ({sorted(steps)[:4]})"
    return steps.pop()


def distrib_moments(path: str, saved: Any, chunks: list[dict[str, torch.Tensor]], args: Any,
                    stage: tuple[int, int]) -> tuple[list[dict[str, dict[str, torch.Tensor]]], float] | str:
    """Per model chunk: field (exp_avg, exp_avg_sq, main) -> parameter name -> this rank's tensor, and Adam's
    step, from the rank's ``distrib_optim.pt`` at ``path`` and its file's ``optimizer`` (``saved``: one
    optimizer's ``state_dict()``, or a ChainedOptimizer's list); ``chunks`` the rank's parameters per model
    chunk (state dicts without buffers), ``stage`` its (PP rank, PP size). An optimizer saved by another rank
    (None here) is left out: the dense state of an EP run is in its EP rank 0's file. Or why not read."""
    saved = saved if isinstance(saved, list) else [saved]
    step, kinds, states = _saved_step(saved, path), _kinds(saved, path), _states(path)
    for got in (step, kinds, states):
        if isinstance(got, str):
            return got
    if len(states) != len(saved):
        return f"{path}: holds {len(states)} optimizers' states, its rank file's optimizer {len(saved)}"
    params = [{k: t for k, t in chunk.items() if not BUFFERS.search(k)} for chunk in chunks]
    numel = sum(t.numel() for chunk in params for t in chunk.values())
    out: list[dict[str, dict[str, torch.Tensor]]] = [{} for _ in chunks]
    for state, kind in zip(states, kinds):
        if state is None:
            continue
        held, buffers = _held(params, kind), _buffers(path, state, kind)
        if isinstance(buffers, str):
            return buffers
        if len(buffers) != len(held):
            return (f"{path}: the {kind} optimizer holds {len(buffers)} gradient buffers for {len(held)} model chunks "
                    "(one buffer per chunk is read: not mixed dtypes)")
        for (c, mine), fields in zip(held, buffers):
            got = _read_buffer(path, fields, mine, args, (stage, c, numel))
            if isinstance(got, str):
                return got
            for field, per in got.items():
                out[c].setdefault(field, {}).update(per)
    return out, step
