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

from megalite.checkpointing.safe_pickle import UnsafePickleError, load_plain_pickle, load_torch_file


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

    from megalite.checkpointing.safe_pickle import load_torch_file

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
