"""megatron-core on a CPU-only torch, for the Megatron import tests (tests/test_megatron_import.py).

megatron-core is the reference here, never a dependency of megalite. A few of its paths ask CUDA for a
device or an RNG state even when told to initialise on the CPU; ``cpu_shim`` patches exactly those, in
the rank process that calls it:

- ``torch.cuda.current_device``: its global memory buffer (the local attention's matmul input) and the
  save's failure all-reduce allocate on it; here it names the CPU.
- ``torch.cuda.synchronize``: the save's pre-load waits for the device; nothing to wait for.
- the torch_dist writer hands its results over a queue of a spawned manager process and writes in
  forked children; the test ranks are daemonic processes, which may not have children. Its result queue
  becomes an in-process one and this rank is marked non-daemonic (the harness still kills it on timeout).
  Its children log their memory through psutil, which the test environment need not have: 0 here.
- the model-parallel RNG tracker's ``fork`` (dropout regions) saves and restores the CUDA RNG; with
  dropout off it draws nothing, so it becomes a plain context.
"""

from __future__ import annotations

import contextlib


def cpu_shim() -> None:
    """Patch the CUDA calls megatron-core makes on the CPU (see the module docstring)."""
    import multiprocessing
    import queue

    import torch
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    filesystem_async._results_queue = queue.Queue()
    multiprocessing.current_process()._config["daemon"] = False
    filesystem_async._process_memory = lambda: 0
