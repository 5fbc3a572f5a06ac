"""Promise (docs/checkpoints.md, "Megatron-LM checkpoints"): a Megatron checkpoint's pickles are read with
an allow-list; a pickle naming anything else (``os.system``) is refused in one line naming the file and
the global, and nothing of it runs."""

from __future__ import annotations

import argparse
import os
import pickle
import random

import numpy as np
import pytest
import torch

from megalite.checkpointing.megatron.safe_pickle import UnsafePickleError, load_plain_pickle, load_torch_file


class _Evil:
    """Unpickling this calls os.system, which would create the file named in the command."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_torch_file_naming_os_system_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "model_optim_rng.pt"
    torch.save({"model": {"w": torch.ones(2)}, "x": _Evil(str(marker))}, path)
    with pytest.raises(UnsafePickleError, match=r"model_optim_rng\.pt: refused to unpickle (posix|os)\.system"):
        load_torch_file(str(path))
    assert not marker.exists()


def test_a_plain_pickle_naming_os_system_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps({"x": _Evil(str(marker))}))
    with pytest.raises(UnsafePickleError, match=r"\.metadata: refused to unpickle (posix|os)\.system"):
        load_plain_pickle(str(path))
    assert not marker.exists()
    path.write_bytes(pickle.dumps(argparse.Namespace(a=1)))  # allowed in torch files, not in .metadata
    with pytest.raises(UnsafePickleError, match="argparse.Namespace"):
        load_plain_pickle(str(path))


def test_what_megatron_saves_loads(tmp_path):
    """args (a Namespace with a dtype and an enum of megatron's), numpy / Python / torch RNG states."""
    from megatron.core.transformer.enums import AttnBackend  # the reference's own enum, pickled by name

    args = argparse.Namespace(num_layers=2, params_dtype=torch.bfloat16, attention_backend=AttnBackend.auto)
    state = {"args": args, "iteration": 7, "rng_state": [{"random_rng_state": random.getstate(),
                                                          "np_rng_state": np.random.get_state(),
                                                          "torch_rng_state": torch.get_rng_state()}]}
    path = tmp_path / "model_optim_rng.pt"
    torch.save(state, path)
    got = load_torch_file(str(path))
    assert got["args"].params_dtype is torch.bfloat16
    assert got["args"].attention_backend.value == AttnBackend.auto.value  # an inert stand-in holding the value
    assert np.array_equal(got["rng_state"][0]["np_rng_state"][1], state["rng_state"][0]["np_rng_state"][1])
    assert got["iteration"] == 7


def test_a_truncated_file_is_named(tmp_path):
    path = tmp_path / "common.pt"
    torch.save({"a": torch.ones(3)}, path)
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(Exception, match="common.pt: not a readable torch file"):
        load_torch_file(str(path))
    with pytest.raises(Exception, match="missing"):
        load_torch_file(str(tmp_path / "absent.pt"))


def test_a_load_leaves_the_process_safe_globals_as_it_found_them(tmp_path):
    """The allow-list is added for one call only and never takes away what the host process registered
    (megatron-core registers argparse.Namespace at import; a load that unregistered it broke megatron-core's
    own loads of common.pt afterwards)."""
    import argparse

    import torch

    from megalite.checkpointing.megatron.safe_pickle import load_torch_file

    path = str(tmp_path / "common.pt")
    torch.save({"args": argparse.Namespace(a=1)}, path)
    before = list(torch.serialization.get_safe_globals())
    torch.serialization.add_safe_globals([argparse.Namespace])
    try:
        assert load_torch_file(path)["args"].a == 1
        assert argparse.Namespace in torch.serialization.get_safe_globals()
        assert torch.load(path, weights_only=True)["args"].a == 1  # the host's own load still works
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def _rng_folder(folder, value) -> str:
    """A torch_dist iteration folder whose one byte item is ``rng_state`` of a TP1 x PP1 run holding
    ``value``, written by torch.distributed.checkpoint as megatron-core's planner writes a ShardedObject:
    ``torch.save`` of the value, no flattening (and no storage metadata, as megatron-core records none)."""
    import json

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class Writer(dcp.FileSystemWriter):
        def storage_meta(self) -> None:
            return None

    dcp.save({"rng_state/shard_0.0_1.1": value}, storage_writer=Writer(str(folder)), no_dist=True,
             planner=DefaultSavePlanner(flatten_state_dict=False))
    torch.save({"iteration": 1}, folder / "common.pt")
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    return str(folder)


def test_an_rng_byte_item_naming_os_system_is_refused_and_never_run(tmp_path):
    """torch_dist's RNG states are unpickled through the allow-list when a run restores them: a pickle naming
    os.system (or a graph-safe tracker's torch.Generator, which is no plain state either) is refused naming it
    and the flag that loads without them; the folder itself opens, since only the item's name is read with it."""
    from megalite.checkpointing.megatron.rng import dist_rng
    from megalite.checkpointing.megatron.torch_dist.reader import DistCheckpoint

    marker = tmp_path / "ran"
    for folder, name, value in ((tmp_path / "system", "(posix|os)\\.system", _Evil(str(marker))),
                                (tmp_path / "generator", "torch\\._C\\.Generator", torch.Generator())):
        folder.mkdir()
        saved = dist_rng(DistCheckpoint(_rng_folder(folder, [[{"torch_rng_state": value}]])))
        with pytest.raises(UnsafePickleError, match=rf"__0_0\.distcp \(rng_state/shard_0\.0_1\.1 at byte 0\): "
                                                    rf"refused to unpickle {name}: .*--no-load-rng"):
            saved.read((0, 0))
    assert not marker.exists()
    state = {"torch_rng_state": torch.get_rng_state(), "np_rng_state": np.random.get_state(),
             "random_rng_state": random.getstate()}
    (tmp_path / "good").mkdir()
    got = dist_rng(DistCheckpoint(_rng_folder(tmp_path / "good", [[state]]))).read((0, 0))
    assert torch.equal(got[0]["torch_rng_state"], state["torch_rng_state"])
