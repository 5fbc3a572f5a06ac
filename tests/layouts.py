"""The layouts-vs-serial pattern of the multi-rank tests, written once.

A test names its runs as flat configs (``MegaliteConfig.from_flat`` keys, the layout's flags included) on
mock data. The single-process reference of a config is trained once per pytest session, in the test
process, however many modules and point-to-point modes compare against it; the layouts train on real
ranks, many per launch (one set of processes runs them one after another). ``assert_matches_serial``
then holds every rank's loss and grad-norm curve to the reference. Where a test needs more of a run than its
curves (bytes moved, what a rank holds), a per-run ``extract`` (a module-level function, so the ranks can
unpickle it) reads it from the run's result and groups into ``Curve.extra``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from megalite.config import validate
from megalite.config.arguments import MegaliteConfig
from megalite.launch.run import build_groups
from megalite.parallel.groups import NCCL_SEMANTICS_ENV, ProcessGroups
from megalite.training.loop import TrainResult, pretrain
from tests.asserts import assert_rel_close
from tests.harness import run_ranks
from tests.tp_utils import mock_data

P2P_MODES = ("gloo", "nccl_semantics")  # plain gloo, and NCCL's point-to-point rules emulated on gloo
Extract = Callable[[TrainResult, ProcessGroups], Any]  # what else a test reads from a run


@dataclass(frozen=True)
class Curve:
    losses: list[float]
    grad_norms: list[float | None]
    valid_losses: list[tuple[int, float]]
    extra: Any = None  # what the run's ``extract`` returned


def _quiet(_: str) -> None:
    pass


def train(flat: Mapping[str, Any], pg: ProcessGroups, world: int, extract: Extract | None = None,
          local_world: int | None = None) -> Curve:
    """Train the flat config on ``pg`` over mock data of its vocab, sequence, seed and length (validated
    for ``world`` ranks, ``local_world`` of them per node)."""
    cfg = MegaliteConfig.from_flat(dict(flat))
    validate(cfg, world, local_world_size=local_world)
    t = cfg.training
    data = mock_data(flat["vocab_size"], cfg.model.seq_length, t.seed, t.train_iters * t.global_batch_size,
                     documents=cfg.data.packs_documents)
    res = pretrain(cfg, pg, data=data, log=_quiet)
    extra = extract(res, pg) if extract is not None else None
    return Curve(list(res.losses), list(res.grad_norms), list(res.valid_losses), extra)


_SERIAL: dict[str, Curve] = {}


def serial_curve(flat: Mapping[str, Any], extract: Extract | None = None) -> Curve:
    """The single-process run of ``flat`` (its parallel flags are the caller's to leave out), trained once
    per session in this process on one thread, as a rank trains; ``extract`` fills ``Curve.extra``."""
    key = repr((sorted(flat.items()), extract and f"{extract.__module__}.{extract.__qualname__}"))
    if key not in _SERIAL:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _SERIAL[key] = train(flat, ProcessGroups.single(), 1, extract)
        finally:
            torch.set_num_threads(threads)
    return _SERIAL[key]


def _train_all(rank: int, world: int, runs: dict[Any, dict[str, Any]], modes: dict[Any, str],
               extract: dict[Any, Extract], prepare: Callable[[], None] | None,
               local_world: int | None) -> dict[Any, Curve]:
    if prepare is not None:
        prepare()
    launch_mode = os.environ.get(NCCL_SEMANTICS_ENV)
    out = {}
    for name, flat in runs.items():
        if name in modes:  # read when the run's groups are built
            os.environ[NCCL_SEMANTICS_ENV] = "1" if modes[name] == "nccl_semantics" else "0"
        elif launch_mode is None:
            os.environ.pop(NCCL_SEMANTICS_ENV, None)
        else:
            os.environ[NCCL_SEMANTICS_ENV] = launch_mode
        cfg = MegaliteConfig.from_flat(dict(flat))
        pg = build_groups(cfg, world, rank, local_world)
        out[name] = train(flat, pg, world, extract.get(name), local_world)
    return out


def layout_curves(world: int, runs: dict[Any, dict[str, Any]], modes: Mapping[Any, str] | None = None,
                  timeout: float = 400.0, *, extract: Mapping[Any, Extract] | None = None,
                  prepare: Callable[[], None] | None = None, local_world: int | None = None
                  ) -> list[dict[Any, Curve]]:
    """Every run of ``runs`` (name -> flat config) trained on the same ``world`` ranks, one after another;
    per rank, name -> Curve. ``modes`` gives a run its point-to-point mode (P2P_MODES); the others run in
    the mode of the launch. ``extract`` gives a run what to read into ``Curve.extra``; ``prepare`` runs
    once in each rank before the runs (e.g. to make the process look like another torch); ``local_world``
    ranks share a node (default: all)."""
    return run_ranks(_train_all, world, runs, dict(modes or {}), dict(extract or {}), prepare, local_world,
                     timeout=timeout)


@contextlib.contextmanager
def p2p_mode(mode: str) -> Iterator[None]:
    """Plain gloo, or MEGALITE_NCCL_SEMANTICS=1 for the ranks started inside (the harness passes it on)."""
    assert mode in P2P_MODES, mode
    patch = pytest.MonkeyPatch()
    if mode == "nccl_semantics":
        patch.setenv(NCCL_SEMANTICS_ENV, "1")
    else:
        patch.delenv(NCCL_SEMANTICS_ENV, raising=False)
    try:
        yield
    finally:
        patch.undo()


class ModeCache:
    """Results of a module's shared multi-rank launch, one per point-to-point mode, made on first use."""

    def __init__(self, make: Callable[[str], Any]) -> None:
        self.make, self.done = make, {}

    def __call__(self, mode: str) -> Any:
        if mode not in self.done:
            with p2p_mode(mode):
                self.done[mode] = self.make(mode)
        return self.done[mode]


def assert_matches_serial(per_rank: list[dict[Any, Curve]], name: Any, ref: Curve, iters: int, rtol: float = 1e-5,
                          ranks: list[int] | None = None) -> None:
    """Every rank's (or the listed ranks') loss and grad-norm curves of run ``name`` equal the reference."""
    assert len(ref.losses) == iters and len(set(ref.losses)) == iters, "the reference must move every iteration"
    assert all(n > 0 for n in ref.grad_norms), "the reference's grad norms must be positive"
    for rank in ranks if ranks is not None else range(len(per_rank)):
        got = per_rank[rank][name]
        assert len(got.losses) == iters, f"{name} rank {rank}: {len(got.losses)} iterations, not {iters}"
        assert_rel_close(got.losses, ref.losses, rtol, f"{name} rank {rank}: loss vs serial")
        assert_rel_close(got.grad_norms, ref.grad_norms, rtol, f"{name} rank {rank}: grad norm vs serial")


class LayoutMatrix:
    """(model, layout) cases trained on ``world`` ranks against their serial runs, in both point-to-point
    modes: every case under NCCL semantics, the ``gloo`` ones also on plain gloo. ``flat(model, tp, pp, cp,
    **extra)`` makes a case's config from ``layouts[name] = (tp, pp, cp, extra)``; one launch per mode."""

    def __init__(self, world: int, flat: Callable[..., dict], layouts: Mapping[str, tuple],
                 cases: list[tuple[str, str]], gloo: list[tuple[str, str]]) -> None:
        self.world, self.flat, self.layouts, self.cases, self.gloo = world, flat, layouts, cases, gloo
        self.curves = ModeCache(self._launch)

    def _launch(self, mode: str) -> list[dict]:
        cases = self.cases if mode == "nccl_semantics" else self.gloo
        runs = {(m, n): self.flat(m, *self.layouts[n][:3], **self.layouts[n][3]) for m, n in cases}
        return layout_curves(self.world, runs)

    def params(self) -> list[tuple[str, str, str]]:
        """(mode, model, layout) of every comparison, for ``pytest.mark.parametrize``."""
        return [(mode, m, n) for mode in P2P_MODES for m, n in self.cases
                if mode == "nccl_semantics" or (m, n) in self.gloo]

    def check(self, mode: str, model: str, layout: str, iters: int, rtol: float = 1e-5) -> None:
        assert_matches_serial(self.curves(mode), (model, layout), serial_curve(self.flat(model)), iters, rtol)
