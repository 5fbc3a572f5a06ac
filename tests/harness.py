"""Run a function on N real ranks (processes) joined by torch.distributed over gloo.

Workers are forked from a forkserver that has already imported torch, so start-up is cheap; each
worker uses one thread. A rank that raises fails the test with that rank's traceback; a rank that does
not answer within ``timeout`` seconds fails it too (never a hang).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import random
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # torch._dynamo: torch.optim's first optimizer imports it (about 2 s of CPU per rank otherwise)
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torch.optim", "megalite.model",
                                     "megalite.training.loop", "megalite.checkpointing", "safetensors.torch"])
    return _CTX


# Ports below the kernel's ephemeral range (32768-60999 by default): a port the kernel hands out itself
# (port 0) can be handed again to any outgoing connection, e.g. gloo's between ranks of another test,
# in the moment between this check and the store binding it.
_PORTS = range(20000, 32000)
_RNG = random.Random()  # its own generator: a test that seeds ``random`` must not fix the ports


def free_port() -> int:
    """A TCP port on the loopback that was free a moment ago, outside the ephemeral range."""
    for _ in range(100):
        port = _RNG.choice(_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORTS.start}-{_PORTS.stop - 1} after 100 tries")


class _PortTaken(Exception):
    """The rendezvous port was taken between choosing it and binding it: start the ranks again."""


# How a rank says its rendezvous store could not bind (the only failure run_ranks retries).
_PORT_TAKEN = "EADDRINUSE"


# Variables of the test process that the ranks must see (the forkserver's own environment is older).
PASSED_ENV = ("MEGALITE_NCCL_SEMANTICS",)


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, results, timeout: float,
            env: dict[str, str]) -> None:
    for name in PASSED_ENV:
        os.environ.pop(name, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1", **env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout))
        except Exception as e:  # noqa: BLE001 - only a taken port is retried, all else is reported
            if _PORT_TAKEN in str(e):
                results.put((rank, None, _PORT_TAKEN))
                return
            raise
        out = fn(rank, world, *args)
        # by value: the queue's own pickler would pass tensors as shared-memory handles, which some torch
        # releases (2.6) hand over through a socket of this process, gone once it exits
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - report any failure with its rank
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return the results in rank order.

    A port taken before rank 0's store could bind it is the one failure tried again (on a new port, up
    to three times): it happens before ``fn`` runs, so nothing has been done twice."""
    for attempt in range(3):
        try:
            return _run_once(fn, world, args, timeout)
        except _PortTaken:
            if attempt == 2:
                raise RuntimeError("the rendezvous port was taken three times running") from None
    raise AssertionError("unreachable")


def _run_once(fn: Callable[..., Any], world: int, args: tuple, timeout: float) -> list[Any]:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, results, timeout, env), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    taken = False
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world and not errors:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                missing = sorted(set(range(world)) - set(out))
                dead = [r for r in missing if not procs[r].is_alive()]
                if dead:  # died without reporting (killed, crashed interpreter, failed to start)
                    time.sleep(0.5)  # a result it queued just before exiting may still be in flight
                    if results.empty():
                        codes = {r: procs[r].exitcode for r in dead}
                        raise RuntimeError(f"ranks {dead} exited without a result (exit codes {codes})") from None
                    continue
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {missing} gave no result within {timeout:.0f} s") from None
                continue
            if ok is None:
                taken = True
                raise _PortTaken()
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors.append(f"--- rank {rank} failed:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=0.5 if errors or taken else 5)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [out[r] for r in range(world)]
