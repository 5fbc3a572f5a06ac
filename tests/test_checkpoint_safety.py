"""Promises of checkpoint files, in process and fast (no training run):
- one writer per --save folder: a second run is refused naming the first (host, pid), a stale lock is
  taken over with a notice, a lock of another host is not;
- replacing an iteration: a kill between any two steps of the commit leaves a loadable checkpoint (the
  old or the new one, never nothing), and the next writer's start-up clears what is left;
- the tracker and metadata.json are checked before use, each failure naming the file and what is wrong;
- a peer rank that vanished is one line naming it, Ctrl-C one line and status 130;
- a data file truncated under a running job is named, not a bus error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from megalite.checkpointing import lock as lock_module
from megalite.checkpointing import paths
from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.full_reader import FullCheckpoint
from megalite.checkpointing.lock import LOCK, Owner, SaveLock
from megalite.checkpointing.metadata import config_dict
from megalite.checkpointing.paths import (
    COMMIT_STEPS,
    EXCHANGE_STEPS,
    TRACKER,
    iter_dirname,
    read_tracker,
    recover,
    staging_dir,
)
from megalite.checkpointing.schema import check_metadata, check_optim_meta
from megalite.checkpointing.writer import write_checkpoint
from megalite.config.model import ModelConfig
from megalite.data.errors import CorruptDatasetError
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, bin_path
from tests.test_failure_reporting import _boards

VOCAB = 64
CONFIG = config_dict(ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8), VOCAB)
NOTES: list[str] = []


def _write(d: str, value: float, iteration: int = 2) -> str:
    """A checkpoint of CONFIG whose every weight is ``value``."""
    return write_checkpoint(d, CONFIG, lambda key: _full(key, value), tp=1, pp=1, iteration=iteration)


def _full(key: str, value: float) -> torch.Tensor:
    return torch.full(_SHAPES[key], value)


def _shapes() -> dict[str, tuple[int, ...]]:
    from megalite.checkpointing.stored import named_params
    from megalite.model.gpt import GPTModel
    from megalite.parallel.groups import ProcessGroups
    from megalite.tensor_parallel.context import BuildContext
    from megalite.tensor_parallel.random import RNGTracker

    ctx = BuildContext(ProcessGroups.single(), RNGTracker(), device=torch.device("meta"))
    model = GPTModel(ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8), ctx, VOCAB)
    return {k: tuple(p.shape) for n, k, p in named_params([model]) if n == k}


_SHAPES = _shapes()


def _value(d: str) -> float:
    """The weights' value of the checkpoint ``d`` loads (every parameter checked)."""
    ck = FullCheckpoint(d)
    values = {float(ck.param(k).flatten()[0]) for k in ck.keys()}
    assert len(values) == 1
    return values.pop()


# ---- one writer per folder ---------------------------------------------------------------------------


def test_a_second_writer_is_refused_naming_the_first(tmp_path):
    first = SaveLock(str(tmp_path))
    first.acquire(NOTES.append)
    with pytest.raises(CheckpointError, match=rf"is in use by another run \(host .*, pid {os.getpid()}, started"):
        SaveLock(str(tmp_path)).acquire(NOTES.append)
    first.release()
    assert not os.path.exists(tmp_path / LOCK)
    second = SaveLock(str(tmp_path))
    second.acquire(NOTES.append)  # free again
    second.release()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _plant(tmp_path, owner: Owner) -> None:
    with open(tmp_path / LOCK, "w") as f:
        json.dump(owner.__dict__, f)


def test_a_stale_lock_is_taken_over_with_a_notice(tmp_path):
    me = lock_module.me()
    _plant(tmp_path, Owner(me.host, _dead_pid(), None, "earlier", "x"))
    notes: list[str] = []
    lock = SaveLock(str(tmp_path))
    lock.acquire(notes.append)
    assert len(notes) == 1 and "taking over the lock of a run that is gone" in notes[0]
    assert lock_module.read_owner(str(tmp_path / LOCK)) == lock.owner
    lock.release()


def test_an_empty_lock_is_refused_until_it_is_old(tmp_path, monkeypatch):
    """A run killed between creating its lock and writing its owner leaves an empty file."""
    (tmp_path / LOCK).write_bytes(b"")
    monkeypatch.setattr(lock_module, "READ_WAIT_S", 0.0)
    with pytest.raises(CheckpointError, match="names no owner"):
        SaveLock(str(tmp_path)).acquire(NOTES.append)
    os.utime(tmp_path / LOCK, (1, 1))
    notes: list[str] = []
    lock = SaveLock(str(tmp_path))
    lock.acquire(notes.append)
    assert len(notes) == 1 and "(no owner written)" in notes[0]
    lock.release()


def test_a_lock_of_this_job_on_another_host_is_stale(monkeypatch):
    """A Slurm job requeued on another node (or a torchrun restart there) takes over its own lock; another
    job's, or torchrun's default rendezvous id "none", does not."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert lock_module.is_stale(Owner("another-host", 123, None, "earlier", "x", "slurm 42"))
    assert not lock_module.is_stale(Owner("another-host", 123, None, "earlier", "x", "slurm 41"))
    assert not lock_module.is_stale(Owner("another-host", 123, None, "earlier", "x", ""))
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert lock_module.job_id() == ""
    assert not lock_module.is_stale(Owner("another-host", 123, None, "earlier", "x", ""))


def test_a_reused_pid_is_stale_and_another_hosts_lock_is_not(tmp_path):
    me = lock_module.me()
    assert lock_module.is_stale(Owner(me.host, os.getpid(), "1", "earlier", "x"))  # same pid, other process
    assert not lock_module.is_stale(me)
    _plant(tmp_path, Owner("another-host", _dead_pid(), None, "earlier", "x"))
    with pytest.raises(CheckpointError, match=r"host another-host, pid .* if that run is gone, remove .*" + LOCK):
        SaveLock(str(tmp_path)).acquire(NOTES.append)


def test_staging_names_are_unique_per_process(tmp_path, monkeypatch):
    mine = staging_dir(str(tmp_path), 4)
    assert mine == staging_dir(str(tmp_path), 4)  # one name per run: its ranks and its cleanup agree
    monkeypatch.setattr(paths.os, "getpid", lambda: 1)  # another run (a pid on this or another host)
    other = staging_dir(str(tmp_path), 4)
    assert other.startswith(str(tmp_path / ".iter_0000004.incomplete.1-")) and other != mine


# ---- replacing an iteration: kills between the steps --------------------------------------------------


class Killed(BaseException):
    pass


@pytest.fixture(scope="module")
def new_version(tmp_path_factory) -> str:
    """A complete iteration-2 folder whose weights are 2.0, to be committed over one whose weights are 1.0."""
    d = str(tmp_path_factory.mktemp("new") / "ck")
    _write(d, 2.0)
    return os.path.join(d, iter_dirname(2))


REPLACES = [("exchange", s) for s in EXCHANGE_STEPS] + [("two renames", s) for s in COMMIT_STEPS]


def _can_exchange(root: str) -> bool:
    a, b = os.path.join(root, "a"), os.path.join(root, "b")
    os.makedirs(a)
    os.makedirs(b)
    return paths.exchange(a, b)


@pytest.mark.parametrize("mode,step", REPLACES)
def test_a_kill_between_any_two_steps_of_a_replace_leaves_a_loadable_checkpoint(tmp_path, monkeypatch, new_version,
                                                                                mode, step):
    d = str(tmp_path / "ck")
    _write(d, 1.0)
    staged = staging_dir(d, 2, "other-run")
    shutil.copytree(new_version, staged)
    if mode == "exchange" and not _can_exchange(str(tmp_path / "probe")):
        pytest.skip("no atomic exchange of two folders on this system or file system")
    if mode == "two renames":
        monkeypatch.setattr(paths, "exchange", lambda a, b: False)

    def kill(done: str) -> None:
        if done == step:
            raise Killed(done)

    monkeypatch.setattr(paths, "FAULT", kill)
    with pytest.raises(Killed):
        paths.commit(d, 2, staged)
    monkeypatch.setattr(paths, "FAULT", None)
    assert read_tracker(d) == 2
    assert _value(d) == (1.0 if step == "old moved aside" else 2.0)
    recover(d)  # the next writer's start-up
    assert sorted(os.listdir(d)) == [iter_dirname(2), TRACKER]
    assert _value(d) == (1.0 if step == "old moved aside" else 2.0)


def test_an_untouched_replace_leaves_one_folder(tmp_path, new_version):
    d = str(tmp_path / "ck")
    _write(d, 1.0)
    _write(d, 2.0)
    assert sorted(os.listdir(d)) == [iter_dirname(2), TRACKER] and _value(d) == 2.0


def test_the_offline_writer_names_a_full_disk_and_leaves_nothing(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    from megalite.checkpointing import writer

    def full(tensors, path, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(writer, "save_tensors", full)
    d = str(tmp_path / "ck")
    with pytest.raises(CheckpointError, match=f"--save {d}: writing iteration 2 failed .*No space left on device"):
        _write(d, 1.0)
    assert not os.path.exists(d)


# ---- the tracker and metadata.json checked before use ---------------------------------------------------


@pytest.mark.parametrize("content, named", [
    (b"\x00\xff\xfe", "binary bytes"),
    ("١٢".encode(), "not ASCII digits"),  # passes str.isdigit() and int()
    (b"-3", "a signed number"),
    (b"+3", "a signed number"),
    (b" 2", "whitespace around the number"),
    (b"2\n\n", "whitespace around the number"),
    (b"2 3", "'2 3'"),
    (b"", "nothing"),
    (b"9" * 40, "33+ bytes"),
])
def test_a_bad_tracker_is_named(tmp_path, content, named):
    (tmp_path / TRACKER).write_bytes(content)
    with pytest.raises(CheckpointError, match="expected an iteration number") as err:
        read_tracker(str(tmp_path))
    assert named in str(err.value) and TRACKER in str(err.value)


@pytest.mark.parametrize("content", [b"2", b"2\n", b"0002"])
def test_a_good_tracker_reads(tmp_path, content):
    (tmp_path / TRACKER).write_bytes(content)
    assert read_tracker(str(tmp_path)) == 2


def _meta() -> dict:
    return {"format_version": 1, "iteration": 2, "layout": {"world_size": None, "tp": 1, "pp": 1, "dp": 1, "vp": 1,
            "order": "tp-cp-dp-pp", "distributed_optimizer": False}, "config": dict(CONFIG),
            "state": {"iteration": 2, "consumed_samples": 8}, "checksums": {"a": "crc32:00000000"}}


def _edit(path: str, value):
    meta = _meta()
    *parents, last = path.split(".")
    node = meta
    for p in parents:
        node = node[p]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return meta


@pytest.mark.parametrize("path, value, named", [
    ("layout", [1, 2], "layout is list"),
    ("layout.tp", "2", "layout.tp is '2', expected an integer >= 1"),
    ("layout.tp", 0, "layout.tp is 0"),
    ("layout.pp", KeyError, "key layout.'pp' is missing"),
    ("layout.distributed_optimizer", "no", "layout.distributed_optimizer"),
    ("iteration", -1, "iteration is -1"),
    ("iteration", True, "iteration is True"),
    ("config.vocab_size", KeyError, "key config.'vocab_size' is missing"),
    ("config.hidden_size", "16", "config.hidden_size is '16'"),
    ("config.swiglu", 1, "config.swiglu is 1"),
    ("state.consumed_samples", 1.5, "state.consumed_samples is 1.5"),
    ("state", None, "state is NoneType"),
    ("checksums", {"a": 1}, "checksums['a'] is 1"),
    ("tokenizer", {"vocab_file": ["a"]}, "tokenizer.vocab_file is ['a']"),
])
def test_metadata_of_the_wrong_shape_is_named(path, value, named):
    with pytest.raises(CheckpointError, match="metadata.json: ") as err:
        check_metadata(_edit(path, value), "ck/iter_0000002/metadata.json")
    assert named in str(err.value)


def test_good_metadata_and_top_level_list():
    assert check_metadata(_meta(), "m") == _meta()
    with pytest.raises(CheckpointError, match="m: the top level is list"):
        check_metadata([], "m")


@pytest.mark.parametrize("raw, named", [
    (None, "key 'meta' is missing"),
    ({"meta": "{"}, "'meta' is not JSON"),
    ({"meta": json.dumps({"step": "1", "regions": {}})}, "meta.step is '1'"),
    ({"meta": json.dumps({"step": 1, "regions": {"w": [0, 9, [2, 2]]}})}, "meta.regions['w']"),
    ({"meta": json.dumps({"step": 1, "regions": {"w": [0, 4]}})}, "meta.regions['w']"),
])
def test_optimizer_metadata_is_checked(raw, named):
    with pytest.raises(CheckpointError, match="optim.safetensors") as err:
        check_optim_meta(raw, "optim.safetensors")
    assert named in str(err.value)


def test_a_damaged_metadata_file_is_named_on_load(tmp_path):
    d = str(tmp_path / "ck")
    _write(d, 1.0)
    path = os.path.join(d, iter_dirname(2), "metadata.json")
    meta = json.load(open(path))
    meta["layout"]["tp"] = "1"
    json.dump(meta, open(path, "w"))
    with pytest.raises(CheckpointError, match=f"{path}: layout.tp is '1'"):
        FullCheckpoint(d)
    open(path, "wb").write(b"\xff\x00{")
    with pytest.raises(CheckpointError, match=f"{path} is corrupt"):
        FullCheckpoint(d)
    meta["layout"]["tp"] = 1
    text = json.dumps(meta, indent=1)
    open(path, "w").write(text.replace('"iteration":', '"iteration": 1,\n "iteration":', 1))
    with pytest.raises(CheckpointError, match=f"{path}: key 'iteration' is written twice"):
        FullCheckpoint(d)


# ---- library exceptions: a vanished peer, Ctrl-C ---------------------------------------------------------


def test_a_vanished_peer_is_one_line_naming_it(capsys):
    first, _ = _boards()
    first.rv.store.set("pid/1", f"{lock_module.me().host} {_dead_pid()}")
    with first.reporting((ValueError,)):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:5555: "
                           "Connection reset by peer")
    err = capsys.readouterr().err
    assert first.exit_code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("prog: error: rank 0: rank 1 (pid ") and "exited without reporting an error" in err
    assert "Read error [127.0.0.1]:5555: Connection reset by peer" in err


def test_a_vanished_peer_of_another_host_is_one_line(capsys):
    first, _ = _boards()
    with first.reporting((ValueError,)):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:5555")
    err = capsys.readouterr().err
    assert first.exit_code == 2 and err.count("\n") == 1
    assert "a peer rank of this run's groups (not named: it is on another host or not yet seen gone) exited without " \
        "reporting an error" in err


def test_ctrl_c_is_one_line_and_status_130(capsys):
    first, _ = _boards()
    with first.reporting((ValueError,)):
        raise KeyboardInterrupt
    err = capsys.readouterr().err
    assert first.exit_code == 130 and err == ("prog: error: rank 0: interrupted (Ctrl-C); checkpoints already "
                                              "committed are intact, a save in progress was removed\n")


# ---- a data file truncated while in use -------------------------------------------------------------------


def test_a_data_file_truncated_while_in_use_is_named(tmp_path):
    prefix = str(tmp_path / "data")
    w = IndexedDatasetWriter(prefix, np.uint16)
    for _ in range(4):
        w.add_document(np.arange(1000, dtype=np.uint16))
    w.finalize()
    ds = IndexedDataset(prefix)
    assert int(ds.get(3)[-1]) == 999
    os.truncate(bin_path(prefix), 100)
    with pytest.raises(CorruptDatasetError, match=f"{bin_path(prefix)}: data file truncated while in use: 100 bytes"):
        ds.get(3)
