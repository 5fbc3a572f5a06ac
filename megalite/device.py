"""The one module that knows the accelerator: cuda vs cpu, nccl vs gloo, sync, memory, RNG, peak FLOPs,
SDPA kernel choice and the optional NVIDIA apex kernels.

Nothing else in megalite calls ``torch.cuda``; everything asks here, so the CPU path cannot rot.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import resource
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from megalite import compat


def has_cuda() -> bool:
    return torch.cuda.is_available() and os.environ.get("MEGALITE_FORCE_CPU", "0") != "1"


def device_type() -> str:
    return "cuda" if has_cuda() else "cpu"


def backend() -> str:
    """The torch.distributed backend for this device."""
    return "nccl" if has_cuda() else "gloo"


def set_device(local_rank: int) -> torch.device:
    """Bind this process to its accelerator (a no-op on CPU) and return the device."""
    if has_cuda():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return current_device()


def current_device() -> torch.device:
    if has_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize() -> None:
    if has_cuda():
        torch.cuda.synchronize()


def pin_memory_supported() -> bool:
    """Whether host tensors can be page-locked (needs the CUDA runtime): asynchronous host<->device copies."""
    return has_cuda()


def host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor, pinned where the build supports it (the optimizer's offload pool)."""
    return torch.zeros(numel, dtype=dtype, pin_memory=pin_memory_supported())


class SideStream:
    """A second device stream for host<->device copies that overlap the default stream's work. On a
    CPU-only run there is no stream: the same calls run the copies inline, so the code path is one."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream() if has_cuda() else None

    def use(self) -> contextlib.AbstractContextManager:
        """Work issued inside runs on the side stream."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def wait_for_default(self) -> None:
        """Side-stream work issued from now on starts after the default stream's work so far (e.g. gradients)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())

    def default_waits(self) -> None:
        """Default-stream work issued from now on starts after the side stream's (e.g. copied parameters)."""
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)

    def synchronize(self) -> None:
        """The host waits for the side stream's copies (before it reads what they wrote)."""
        if self.stream is not None:
            self.stream.synchronize()


class HostSnapshot:
    """Host copies of tensors that a background thread may read while training changes the originals
    (an asynchronous checkpoint). On CUDA the device->host copies go into page-locked buffers on a side
    stream, after the default stream's work so far; the default stream's later work (the next optimizer
    step) waits for them, so the host never stalls for the copy. Buffers are kept and reused by name
    (the next snapshot may only start once the previous one's reader is done). On the CPU: plain clones.
    The CUDA path is not exercised by the CPU test suite; tests/test_gpu_paths.py checks it on a GPU."""

    def __init__(self) -> None:
        self.side = SideStream()
        self.buffers: dict[str, torch.Tensor] = {}

    def copy(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A contiguous host copy of each tensor (names are the buffers' keys)."""
        if self.side.stream is None:
            return {k: t.detach().clone(memory_format=torch.contiguous_format) for k, t in tensors.items()}
        out = {}
        self.side.wait_for_default()
        with self.side.use():
            for k, t in tensors.items():
                buf = self.buffers.get(k)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    buf = self.buffers[k] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                out[k] = buf.copy_(t.detach(), non_blocking=t.is_cuda)
        self.side.default_waits()
        return out

    def ready(self) -> None:
        """Block until the copies have landed (the reader calls it before touching them)."""
        self.side.synchronize()


def manual_seed(seed: int) -> None:
    """Seed the host and the device generators."""
    torch.manual_seed(seed)
    if has_cuda():
        torch.cuda.manual_seed(seed)


def get_rng_state() -> torch.Tensor:
    """The RNG state that dropout on this device draws from."""
    return torch.cuda.get_rng_state() if has_cuda() else torch.get_rng_state()


def set_rng_state(state: torch.Tensor) -> None:
    if has_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def empty_cache() -> None:
    """Hand the caching allocator's unused blocks back to the device (--empty-unused-memory-level); CPU
    tensors are freed at once, so there is nothing to do there."""
    if has_cuda():
        torch.cuda.empty_cache()


def memory_stats() -> dict[str, float]:
    """Memory in MB: allocated/reserved/peak on a GPU, resident-set peak of the process on CPU."""
    if has_cuda():
        mb = 1024.0 ** 2
        return {
            "allocated_mb": torch.cuda.memory_allocated() / mb,
            "max_allocated_mb": torch.cuda.max_memory_allocated() / mb,
            "reserved_mb": torch.cuda.memory_reserved() / mb,
        }
    return {"max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}


@dataclass(frozen=True)
class MemoryCapacity:
    """The memory one rank of a run may count on, for the start-up memory check: ``total`` bytes shared
    by ``ranks`` ranks; ``what`` says where the number comes from."""

    total: int
    ranks: int
    what: str


def memory_capacity(local_rank: int, local_world: int) -> MemoryCapacity | None:
    """On CUDA the total memory of this rank's device (ranks of the host sharing a device counted); on
    CPU the host's available memory (MemAvailable), which every rank on the host shares; None where the
    host does not say (no /proc/meminfo)."""
    ranks = max(local_world, 1)
    if has_cuda():
        count = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(local_rank % count)  # no context is created on the device
        sharing = -(-ranks // count) if ranks > count else 1
        return MemoryCapacity(int(props.total_memory), sharing, f"{props.name} total memory")
    available = _mem_available()
    if available is None:
        return None
    return MemoryCapacity(available, ranks, "the host's available memory (MemAvailable)")


def _mem_available(path: str = "/proc/meminfo") -> int | None:
    """MemAvailable in bytes, or None where the file or the line is missing."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def device_name() -> str:
    if has_cuda():
        return torch.cuda.get_device_name()
    return "cpu"


def sdpa_kernels(backend: str, where: torch.device) -> contextlib.AbstractContextManager:
    """Restrict SDPA to the kernel --attention-backend names: on CUDA 'flash' is the flash kernel and
    'fused' the memory-efficient one. Elsewhere (CPU) SDPA runs its own CPU kernel for every choice."""
    if where.type != "cuda" or backend not in ("flash", "fused"):
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(compat.sdpa_backend(_SDPA_KERNELS[backend]))


# --attention-backend names that pin one SDPA kernel on CUDA, and the kernel's SDPBackend member.
_SDPA_KERNELS = {"flash": "FLASH_ATTENTION", "fused": "EFFICIENT_ATTENTION"}


def attention_backend_error(backend: str, dtype: torch.dtype) -> str | None:
    """Why --attention-backend cannot run on this device in ``dtype``, or None ('auto' takes what exists)."""
    if backend in _SDPA_KERNELS and has_cuda() and compat.sdpa_backend(_SDPA_KERNELS[backend]) is None:
        return (f"--attention-backend {backend}: torch {torch.__version__} has no SDPA kernel "
                f"{_SDPA_KERNELS[backend]}; use 'auto' or 'unfused'")
    if backend == "flash" and has_cuda() and dtype not in (torch.float16, torch.bfloat16):
        return ("--attention-backend flash needs --bf16 or --fp16 on CUDA (the flash kernel has no fp32 path); "
                "use 'fused', 'auto' or 'unfused' for fp32")
    return None


# Dense (no sparsity) peak TFLOP/s by device name fragment and dtype, from vendor data sheets.
_PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "tf32": 494.0}),
    ("H100", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "tf32": 494.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5, "tf32": 156.0}),
    ("L40S", {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6, "tf32": 183.0}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2, "tf32": 62.5}),
]


def peak_tflops(dtype: torch.dtype) -> float | None:
    """Known peak TFLOP/s of this device for ``dtype``, or None when unknown (e.g. CPU)."""
    if not has_cuda():
        return None
    name = device_name()
    key = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    if key == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        key = "tf32"
    for frag, table in _PEAK_TFLOPS:
        if frag in name:
            return table[key]
    return None


def info() -> dict[str, Any]:
    return {"device": device_name(), "backend": backend(), "torch": torch.__version__}


# NVIDIA apex's fused GPU kernels (Adam, LayerNorm, RMSNorm), used when the real apex is importable. apex is
# built from source on GPU machines and is never a dependency. The PyPI package named ``apex`` is an
# unrelated project, so apex is recognised by the modules megalite uses (``apex.optimizers``,
# ``apex.normalization.fused_layer_norm``) and their compiled CUDA extensions (``amp_C``,
# ``fused_layer_norm_cuda``), never by the top-level name. Looked up lazily, once per process; anything
# that fails to import counts as absent, and the callers fall back to torch.


@functools.cache
def _apex_module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - absent, the unrelated PyPI 'apex', or a build that cannot load
        return None


def clear_apex_cache() -> None:
    """Forget earlier look-ups (tests that install or remove a module)."""
    _apex_module.cache_clear()


def apex_fused_adam_class() -> type | None:
    """``apex.optimizers.FusedAdam``, or None without the real apex or its CUDA extension (``amp_C``)."""
    if _apex_module("amp_C") is None:
        return None
    return getattr(_apex_module("apex.optimizers"), "FusedAdam", None)


def apex_fused_norm(kind: str, device_type: str) -> Callable | None:
    """apex's fused affine norm for ``kind`` ('LayerNorm' or 'RMSNorm') on CUDA tensors, else None.

    LayerNorm: f(x, weight, bias, shape, eps); RMSNorm: f(x, weight, shape, eps)."""
    if device_type != "cuda" or _apex_module("fused_layer_norm_cuda") is None:  # the kernels' extension
        return None
    name = "fused_layer_norm_affine" if kind == "LayerNorm" else "fused_rms_norm_affine"
    return getattr(_apex_module("apex.normalization.fused_layer_norm"), name, None)

