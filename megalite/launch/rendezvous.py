"""Rendezvous: the store every rank of a run meets at, and a wait for all of them that
--distributed-timeout-minutes bounds.

Under torchrun the store is the launcher's (keys private to the restart attempt); otherwise rank 0
hosts a TCPStore at MASTER_ADDR:MASTER_PORT. Each rank then counts itself in, so a rank that never
started is named after the timeout instead of leaving its peers in init_process_group until the
collective timeout ends in a traceback.
"""

from __future__ import annotations

import datetime
import itertools
import os
import socket
import time
from dataclasses import dataclass

import torch.distributed as dist

_RUNS = itertools.count()  # process groups this process made: each gets its own keys in the store
POLL_S = 0.05


class RendezvousError(RuntimeError):
    """The ranks of a run did not all meet: which ones are missing, or why the store cannot be reached."""


@dataclass
class Rendezvous:
    store: dist.Store  # keys of this run only
    hosting: bool  # this process serves the store, so it must be the last to leave
    address: str  # host:port, for messages


def _minutes(timeout: datetime.timedelta) -> str:
    return f"{timeout.total_seconds() / 60:g} min (--distributed-timeout-minutes)"


def _port_open(host: str, port: int, deadline: float) -> bool:
    """Whether something listens at host:port before ``deadline``: probed here so that a store that is
    not up yet costs no error spam from the store client's own retries."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)


def _address() -> tuple[str, int]:
    env = os.environ
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not env.get(v)]
    if missing:
        raise RendezvousError(f"WORLD_SIZE={env.get('WORLD_SIZE')} needs {' and '.join(missing)}: where rank 0 "
                              "hosts the rendezvous store (torchrun sets both)")
    if not env["MASTER_PORT"].isdigit():
        raise RendezvousError(f"MASTER_PORT={env['MASTER_PORT']!r} is not a port number")
    return env["MASTER_ADDR"], int(env["MASTER_PORT"])


def connect(rank: int, world: int, timeout: datetime.timedelta) -> Rendezvous:
    """Host (rank 0 without torchrun) or reach the run's store, within ``timeout``."""
    env = os.environ
    host, port = _address()
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent serves the store
    torchrun = "TORCHELASTIC_RESTART_COUNT" in env
    hosting = rank == 0 and not agent
    where = f"{host}:{port}"
    if not hosting and not _port_open(host, port, time.monotonic() + timeout.total_seconds()):
        raise RendezvousError(f"rank 0, which hosts the rendezvous store at {where} (MASTER_ADDR:MASTER_PORT), "
                              f"never joined within {_minutes(timeout)}")
    try:
        base = dist.TCPStore(host, port, world, is_master=hosting, timeout=timeout, wait_for_workers=False,
                             multi_tenant=torchrun and not agent)
    except dist.DistError as e:
        raise RendezvousError(f"cannot {'host' if hosting else 'reach'} the rendezvous store at {where}: "
                              f"{str(e).splitlines()[0]}") from None
    # Under --max-restarts the launcher may hand a new attempt the old store: its leftover keys (dead
    # ranks' addresses) would send the new ranks to processes that no longer exist.
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return Rendezvous(dist.PrefixStore(f"megalite/attempt_{attempt}/run_{next(_RUNS)}", base), hosting, where)


def ranges(ranks: list[int]) -> str:
    """'1, 3-6' for [1, 3, 4, 5, 6]."""
    parts = []
    for _, grp in itertools.groupby(enumerate(ranks), lambda p: p[1] - p[0]):
        run = [r for _, r in grp]
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(parts)


def join(rv: Rendezvous, rank: int, world: int, timeout: datetime.timedelta) -> None:
    """Count this rank in and wait until all ``world`` ranks have; after ``timeout`` name the missing ones."""
    rv.store.set(f"joined/{rank}", "1")
    rv.store.add("joined", 1)
    deadline = time.monotonic() + timeout.total_seconds()
    while rv.store.add("joined", 0) < world:
        if time.monotonic() >= deadline:
            missing = [r for r in range(world) if not rv.store.check([f"joined/{r}"])]
            raise RendezvousError(f"rank(s) {ranges(missing)} of {world} never joined within {_minutes(timeout)}")
        time.sleep(POLL_S)


def joined(rv: Rendezvous) -> int:
    return rv.store.add("joined", 0)
