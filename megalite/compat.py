"""The one place that adapts megalite to the torch it runs on (every release from ``MIN_TORCH`` on).

Each API newer than the minimum, and each private one, is reached only through a function here, which
detects what this torch offers and falls back to an older or public equivalent (docs/compatibility.md).
Detection is lazy and cached per process; ``reset`` forgets it, so a test can hide an API in a fresh rank
and run the fallback (tests/test_torch_compat.py). tests/test_torch_api_scan.py fails when code outside
this module uses a torch attribute that the minimum release lacks.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

MIN_TORCH = (2, 6)  # the oldest release the whole suite passes on (docs/compatibility.md)

# Every API this module may find missing, by the name tests hide it under: (module, attribute).
OPTIONAL_APIS = {
    "all_gather_single": (dist, "all_gather_single"),  # torch 2.13
    "reduce_scatter_single": (dist, "reduce_scatter_single"),  # torch 2.13
    "_grouped_mm": (torch, "_grouped_mm"),  # private
    "_get_default_store": (dist.distributed_c10d, "_get_default_store"),  # private
    "_current_graph_task_id": (torch._C, "_current_graph_task_id"),  # private
    "_foreach_mul_": (torch, "_foreach_mul_"),  # private
}


def version() -> tuple[int, int]:
    """(major, minor) of this torch."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def too_old() -> str | None:
    """Why this torch is below the supported range, or None."""
    if version() < MIN_TORCH:
        return (f"megalite needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}; this is {torch.__version__} "
                "(docs/compatibility.md lists the proven releases)")
    return None


def _api(name: str) -> Callable | None:
    module, attr = OPTIONAL_APIS[name]
    return getattr(module, attr, None)


def reset() -> None:
    """Forget every detection (after a test hides or restores an API)."""
    for fn in (_flat_collectives, grouped_mm_supported, cpu_flash_attention, cuda_flash_attention,
               cuda_varlen_flash_attention, sdpa_has_gqa):
        fn.cache_clear()


# ---- collectives ---------------------------------------------------------------------------------
@functools.cache
def _flat_collectives() -> tuple[Callable, Callable]:
    """(all-gather, reduce-scatter) into/from one flat tensor: the ``*_single`` names from torch 2.13, the
    ``*_tensor`` ones before (same arguments; gloo and NCCL have both)."""
    gather = _api("all_gather_single") or dist.all_gather_into_tensor
    scatter = _api("reduce_scatter_single") or dist.reduce_scatter_tensor
    return gather, scatter


def all_gather_into_tensor(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """Every rank's ``inp`` into the flat ``out`` in group order."""
    return _flat_collectives()[0](out, inp, group=group, async_op=async_op)


def reduce_scatter_tensor(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """Sum ``inp`` over the group; this rank's 1/n part into ``out``."""
    return _flat_collectives()[1](out, inp, group=group, async_op=async_op)


def p2p_op(send: bool, tensor: torch.Tensor, peer: int, group) -> dist.P2POp:
    """One entry of ``batch_isend_irecv`` toward global rank ``peer`` (the keywords every release has)."""
    return dist.P2POp(op=dist.isend if send else dist.irecv, tensor=tensor, peer=peer, group=group)


def default_store() -> dist.Store:
    """The store of the default process group; without the private accessor, a client of the launcher's
    TCP store (MASTER_ADDR/MASTER_PORT) under megalite's own prefix."""
    get = _api("_get_default_store")
    if get is not None:
        return get()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          wait_for_workers=False)
    return dist.PrefixStore("megalite", store)


# ---- autograd --------------------------------------------------------------------------------------
_replay = threading.local()


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Marks a forward that runs again inside backward (activation recomputation)."""
    _replay.depth = getattr(_replay, "depth", 0) + 1
    try:
        yield
    finally:
        _replay.depth -= 1


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread: torch's graph-task id where the
    build exposes it, else megalite's own mark (the only forward that runs in backward is a recompute)."""
    task_id = _api("_current_graph_task_id")
    if task_id is not None:
        return task_id() != -1
    return getattr(_replay, "depth", 0) > 0


def scale_(tensors: list[torch.Tensor], factor: float) -> None:
    """Multiply every tensor in place (one fused launch where torch has ``_foreach_mul_``)."""
    mul = _api("_foreach_mul_")
    if mul is not None:
        mul(tensors, factor)
        return
    for t in tensors:
        t.mul_(factor)


# ---- kernels ---------------------------------------------------------------------------------------
@functools.cache
def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward on this device type in ``dtype``: decided by
    a small trial call, since builds that have the name refuse some devices and dtypes."""
    mm = _api("_grouped_mm")
    if mm is None:
        return False
    try:
        x = torch.randn(8, 16, device=device_type, dtype=dtype, requires_grad=True)
        w = torch.randn(2, 16, 16, device=device_type, dtype=dtype, requires_grad=True)
        offs = torch.tensor([4, 8], device=device_type, dtype=torch.int32)
        mm(x, w, offs=offs).sum().backward()
        return True
    except Exception:  # noqa: BLE001 - any refusal means: use the loop
        return False


def grouped_mm(x: torch.Tensor, weight_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` in consecutive groups (ends ``offs``) times their group's ``weight_t`` [g, in, out]."""
    return _api("_grouped_mm")(x, weight_t, offs=offs)


def grouped_mm_warning(device_type: str, dtype: torch.dtype) -> str | None:
    """The start-up warning for --moe-grouped-gemm where this build cannot run it, or None."""
    if grouped_mm_supported(device_type, dtype):
        return None
    return (f"--moe-grouped-gemm: torch {torch.__version__} has no grouped GEMM for {dtype} on {device_type}; "
            "the experts run one GEMM each (same results, slower)")


@functools.cache
def cpu_flash_attention() -> tuple[Callable, Callable] | None:
    """(forward, backward) of torch's flash-attention kernel for CPU, which returns the log-sum-exp a
    blockwise softmax needs; None where this build lacks either (the plain blockwise path is used)."""
    aten = torch.ops.aten
    try:
        return aten._scaled_dot_product_flash_attention_for_cpu, \
            aten._scaled_dot_product_flash_attention_for_cpu_backward
    except (AttributeError, RuntimeError):
        return None


@functools.cache
def cuda_flash_attention() -> tuple[Callable, Callable] | None:
    """(forward, backward) of SDPA's flash kernel on CUDA with the log-sum-exp exposed, as plain functions
    ``fwd(q, k, v, causal) -> (out, lse)`` and ``bwd(dout, q, k, v, out, lse, causal) -> (dq, dk, dv)`` on
    [b, h, s, d] fp16/bf16 tensors (equal head counts); None where this build lacks the ops. The private
    ops' argument lists are those of torch 2.1 onwards (verified on a GPU only: docs/compatibility.md)."""
    aten = torch.ops.aten
    try:
        fwd_op, bwd_op = aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward
    except (AttributeError, RuntimeError):
        return None

    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        res = fwd_op(q, k, v, 0.0, causal, False)
        return res[0], res[1]

    def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, h, sq, _ = q.shape
        sk = k.shape[2]
        cum_q = torch.zeros(0, dtype=torch.int32, device=q.device)
        empty = torch.zeros(0, dtype=torch.int64, device=q.device)
        res = bwd_op(dout, q, k, v, out, lse, cum_q, cum_q, sq, sk, 0.0, causal, empty, empty)
        return res[0], res[1], res[2]

    return fwd, bwd


@functools.cache
def cuda_varlen_flash_attention() -> tuple[Callable, Callable] | None:
    """(forward, backward) of the variable-length flash kernel on CUDA (all packed documents in one call) as
    ``fwd(q, k, v, cu_seqlens, max_len) -> (out, lse, state)`` and ``bwd(dout, q, k, v, out, lse, cu_seqlens,
    max_len, state) -> (dq, dk, dv)`` on [tokens, heads, d] fp16/bf16 tensors with equal head counts,
    causal inside each document; None where this build lacks the ops (per-document calls are used). The
    argument lists are those of torch 2.4 onwards (verified on a GPU only: docs/compatibility.md)."""
    aten = torch.ops.aten
    try:
        fwd_op, bwd_op = aten._flash_attention_forward, aten._flash_attention_backward
    except (AttributeError, RuntimeError):
        return None

    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int) -> tuple:
        res = fwd_op(q, k, v, cu, cu, max_len, max_len, 0.0, True, False)
        return res[0], res[1], (res[2], res[3])

    def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, cu: torch.Tensor, max_len: int, state: tuple) -> tuple:
        res = bwd_op(dout, q, k, v, out, lse, cu, cu, max_len, max_len, 0.0, True, state[0], state[1])
        return res[0], res[1], res[2]

    return fwd, bwd


@functools.cache
def sdpa_has_gqa() -> bool:
    """Whether SDPA takes ``enable_gqa`` (fewer key/value heads than query heads)."""
    q = torch.zeros(1, 2, 1, 4)
    kv = torch.zeros(1, 1, 1, 4)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        return True
    except TypeError:
        return False


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
         dropout_p: float = 0.0, is_causal: bool = False) -> torch.Tensor:
    """SDPA with q [b, nq, s, d] and k, v [b, nkv, t, d], nq a multiple of nkv (GQA): the kernel's own
    grouping where it has one, else K/V repeated per query head (the same result)."""
    gqa = q.shape[1] != k.shape[1]
    if gqa and not sdpa_has_gqa():
        rep = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
    extra = {"enable_gqa": True} if gqa else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                          **extra)


def sdpa_backend(name: str):
    """The ``torch.nn.attention.SDPBackend`` member named ``name`` (FLASH_ATTENTION, EFFICIENT_ATTENTION), or
    None where this build lacks it."""
    try:
        from torch.nn.attention import SDPBackend
    except ImportError:
        return None
    return getattr(SDPBackend, name, None)


# ---- look-ups by name ------------------------------------------------------------------------------
def dtype_named(name: str) -> torch.dtype:
    """The dtype whose ``str`` is ``name`` (``torch.bfloat16``; the prefix is optional), e.g. from a peer's
    message header. A string look-up on torch cannot be checked against the minimum API, so it lives here
    (tests/test_torch_api_scan.py)."""
    return getattr(torch, name.removeprefix("torch."))


# ---- restricted loading -------------------------------------------------------------------------
def load_weights_only(stream, extra_globals: list) -> object:
    """``torch.load(stream, weights_only=True)`` on the CPU with ``extra_globals`` allowed for this call only
    (``torch.serialization.safe_globals``, torch 2.5; the Megatron reader, checkpointing/megatron/safe_pickle.py). Only
    the globals not yet registered are added: the context's exit removes what it was given, which would
    unregister a global the host process had allowed itself (megatron-core registers ``argparse.Namespace``
    at import, and its own loads then fail)."""
    registered = torch.serialization.get_safe_globals()
    with torch.serialization.safe_globals([g for g in extra_globals if g not in registered]):
        return torch.load(stream, map_location="cpu", weights_only=True)


# ---- writing torch's distributed-checkpoint format (the Megatron-LM export) ---------------------
def save_distributed_checkpoint(state: dict, folder: str) -> None:
    """``state`` written by torch.distributed.checkpoint into ``folder`` from one process (no process group;
    ``no_dist``, torch 2.3), without the writer's storage metadata: that records the folder as a pathlib path
    in ``.metadata``, a type no reader of Megatron checkpoints needs to unpickle (the project's restricted
    reader refuses it; megatron-core's own writer records none either)."""
    import torch.distributed.checkpoint as dcp

    class _Writer(dcp.FileSystemWriter):
        def storage_meta(self) -> None:
            return None

    dcp.save(state, storage_writer=_Writer(folder), no_dist=True)
