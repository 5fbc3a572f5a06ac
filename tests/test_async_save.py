"""Promises of --async-save (docs/checkpoints.md, "Asynchronous save"), on 2 ranks (DP 2, distributed
optimizer: both ranks write tensor files):
- the files are byte for byte those of a synchronous save of the same iteration, while training goes on
  changing the parameters during the write (a slowed writer spans several steps), and the loss curve is
  the synchronous run's;
- at most one save in flight: each is committed before the next starts, and the last before the run ends;
- a kill at any point of an asynchronous save (host copies taken; a file written; all written; during
  the commit) leaves the previous checkpoint loadable, every file matching its checksum, and the next
  writer's start-up clears what is left;
- --async-save without --save is refused by name."""

from __future__ import annotations

import filecmp
import os
import signal
import time

import pytest

from megalite.checkpointing import async_save, paths
from megalite.checkpointing.paths import TRACKER, iter_dirname, read_tracker, recover
from megalite.checkpointing.reader import CheckpointReader
from megalite.config import ConfigError, validate
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.training.loop import pretrain
from tests.asserts import assert_rel_close
from tests.harness import run_ranks
from tests.tp_utils import LLAMA_GQA, layout_cfg, mock_data

VOCAB = 300
MODEL = {**LLAMA_GQA, "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4}
ITERS = 6


def _train(rank: int, world: int, log=None, **extra):
    cfg = layout_cfg(MODEL, vocab=VOCAB, iters=ITERS, **{"use_distributed_optimizer": True, "log_interval": 1,
                                                          **extra})
    validate(cfg, world)
    data = mock_data(VOCAB, MODEL["seq_length"], 1234, ITERS * 8)
    pg = ProcessGroups.build(RankLayout(world), rank) if world > 1 else ProcessGroups.single()
    return pretrain(cfg, pg, data=data, log=log or (lambda s: None))


def _both(rank: int, world: int, root: str) -> dict:
    """Synchronous saves at 2, 4, 6; then asynchronous ones with a writer slowed to span several steps."""
    sync = _train(rank, world, save=os.path.join(root, "sync"), save_interval=2).losses
    lines: list[str] = []
    async_save.FAULT = lambda point: (lines.append(f"writer: {point}"), time.sleep(0.15))
    try:
        res = _train(rank, world, log=lines.append, save=os.path.join(root, "async"), save_interval=2,
                     async_save=True)
    finally:
        async_save.FAULT = None
    return {"sync": sync, "async": res.losses, "lines": lines}


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("async"))
    return root, run_ranks(_both, 2, root, timeout=300)


def _files(d: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(p, f), d) for p, _, fs in os.walk(d) for f in fs)


def test_an_async_checkpoint_is_the_bytes_of_a_sync_one(both):
    root, ranks = both
    for it in (2, 4, 6):
        a, s = (os.path.join(root, kind, iter_dirname(it)) for kind in ("async", "sync"))
        assert _files(a) == _files(s) and len(_files(s)) >= 5
        match, mismatch, errors = filecmp.cmpfiles(a, s, _files(s), shallow=False)
        assert not mismatch and not errors, (it, mismatch, errors)
    assert read_tracker(os.path.join(root, "async")) == ITERS
    for r in ranks:
        assert_rel_close(r["async"], r["sync"], 0.0, "async-save run vs sync-save run loss")


def test_training_goes_on_during_the_write_and_one_save_is_in_flight(both):
    lines = both[1][1]["lines"]  # the logging rank's log, with its writer's points
    events = [(i, s) for i, s in enumerate(lines) if "checkpoint at iteration" in s]
    kinds = [("saving" if "saving" in s else "saved", s.split("iteration ")[1].split()[0]) for _, s in events]
    assert kinds == [("saving", "2"), ("saved", "2"), ("saving", "4"), ("saved", "4"), ("saving", "6"),
                     ("saved", "6")]
    start, end = events[0][0], events[1][0]
    during = [s for s in lines[start:end] if s.startswith(" [") and " iteration " in s]
    assert during, "no training step ran while iteration 2 was written"
    assert "written in the background" in lines[end]


def test_async_save_needs_save():
    with pytest.raises(ConfigError, match=r"--async-save needs --save"):
        validate(layout_cfg(MODEL, vocab=VOCAB, iters=2, async_save=True), 1)


# ---- kills --------------------------------------------------------------------------------------
KILLS = [("async", "copied"), ("async", "file written"), ("async", "files written"), ("commit", "new moved in"),
         ("commit", "tracker written")]  # the commit's later steps: test_checkpoint_safety.py (the same code)
KILLS_BEFORE_MOVE = {"copied", "file written", "files written"}  # nothing of iteration 4 is in place


def _killed_run(rank: int, world: int, d: str, where: str, point: str) -> None:
    """Asynchronous saves at 2 and 4 (training goes on to 5 while 4 is written); killed (SIGKILL, no
    clean-up) at ``point`` of the save of iteration 4."""
    saves = []

    def count(name: str) -> None:
        saves.append(name == "copied")
        kill(name)

    def kill(name: str) -> None:
        if sum(saves) == 2 and name == point:
            os.kill(os.getpid(), signal.SIGKILL)

    async_save.FAULT, paths.FAULT = count, kill
    _train(rank, world, save=d, save_interval=2, async_save=True, train_iters=5)


def _verified(d: str) -> int:
    """The tracker's iteration, after checking every file of its checkpoint against its checksum."""
    reader = CheckpointReader(d)
    assert reader.checksums
    for rel in reader.checksums:
        reader.verify(os.path.join(reader.dir, rel))
    return reader.iteration


@pytest.mark.parametrize("where,point", KILLS)
def test_a_kill_during_an_async_save_leaves_a_loadable_checkpoint(tmp_path, where, point):
    """One rank (a kill's outcome on disk is each rank's own; the 2-rank agreement is tested above)."""
    d = str(tmp_path / "ck")
    with pytest.raises(RuntimeError, match="exited without a result"):
        run_ranks(_killed_run, 1, d, where, point, timeout=120)
    assert _verified(d) == 2
    assert (iter_dirname(4) in os.listdir(d)) == (point not in KILLS_BEFORE_MOVE)
    recover(d)  # the next writer's start-up
    left = set(os.listdir(d)) - {".megalite-save.lock"}  # the killed run's lock: stale, taken over
    assert left == {TRACKER, iter_dirname(2)} | (set() if point in KILLS_BEFORE_MOVE else {iter_dirname(4)})
    assert _verified(d) == 2
    if point == "file written":  # and training resumes from it
        lines: list[str] = []
        res = _train(0, 1, log=lines.append, load=d, save=d, train_iters=3, async_save=True)
        assert len(res.losses) == 1 and read_tracker(d) == 3 and _verified(d) == 3
        assert any("loaded checkpoint" in s and "iteration 2" in s for s in lines)


def test_equal_tensors_and_metadata_give_equal_bytes(tmp_path):
    """safetensors writes its metadata entries in a per-file hash order; save_tensors sorts them."""
    import torch

    from megalite.checkpointing.metadata import save_tensors

    tensors = {"b": torch.arange(3.0), "a": torch.ones(2, dtype=torch.float16)}
    meta = {"meta": '{"step": 2.0, "name": "\\u00e9"}', "format": "megalite-optim", "x": "y"}
    seen = {(save_tensors(tensors, str(tmp_path / "f.safetensors"), meta), (tmp_path / "f.safetensors").read_bytes())
            for _ in range(8)}
    assert len(seen) == 1
