"""Promise: nothing is lost. Bad checkpoint input, driven through the real entry points (pretrain_gpt.py,
tools/convert_checkpoint.py), exits non-zero with one message naming the flag or file and the way out,
no Python traceback, and every checkpoint already on disk byte-identical afterwards:
- --save holding another run's checkpoint (no --load, --finetune, another model, a later iteration);
- --save onto a file, under a file, into a read-only directory or onto a full disk (start-up probe);
- a save failing mid-way (an OSError, or safetensors' own error for a full disk) or interrupted by Ctrl-C:
  its staging directory is removed, the tracker still names the previous one;
- a second run saving into a folder another live run holds;
- corrupted tensor bytes (checksum in metadata.json), while checkpoints without checksums still load;
- reshard / from-hf into a non-empty destination without --overwrite."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
from safetensors import SafetensorError

from megalite.checkpointing import guard
from megalite.checkpointing import lock as lock_module
from megalite.checkpointing.paths import TRACKER, staging_dir
from tests.cli_utils import ROOT, launch_pretrain, refused, run_pretrain, tree_hash

TOOL = str(ROOT / "tools" / "convert_checkpoint.py")
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
        "--mock-data", "--vocab-size", "128", "--eval-iters", "0", "--log-interval", "1"]
# main() of an entry point run in-process under capsys: torch's @record cannot attach its fault handler
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """A 2-iteration checkpoint of the TINY model, saved by pretrain_gpt.py."""
    root = tmp_path_factory.mktemp("bad_ckpt")
    save = str(root / "base")
    proc = launch_pretrain([*TINY, "--train-iters", "2", "--save", save])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return save


@pytest.fixture
def copy(base, tmp_path):
    """A private copy of the base checkpoint and its tree hash."""
    d = str(tmp_path / "ck")
    shutil.copytree(base, d)
    return d, tree_hash(d)


def convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def load_script(path):
    """Import an entry point script as a module, to call its main() in-process (no interpreter start-up
    per case; main() is what the script runs)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def entry():
    return {"pretrain": load_script(ROOT / "pretrain_gpt.py").main,
            "convert": load_script(ROOT / "tools" / "convert_checkpoint.py").main}


@pytest.fixture
def call(entry, capsys):
    """call(name, argv) -> a CompletedProcess-like result of entry point ``name``'s main() run in-process."""
    def run(name: str, argv: list[str]) -> subprocess.CompletedProcess:
        rc = entry[name](argv)
        out = capsys.readouterr()
        return subprocess.CompletedProcess(argv, rc, out.out, out.err)
    return run


# ---- --save holding another run's checkpoint ---------------------------------------------------------


@pytest.mark.parametrize("extra, why", [
    ([], "no --load"),
    (["--load", "{d}", "--finetune"], "--finetune starts at iteration 0"),
    (["--load", "{d}", "--hidden-size", "64"], "--hidden-size: checkpoint 32, flags 64"),
    (["--load", "{d}", "--swiglu"], "--swiglu: checkpoint False, flags True"),
])
def test_save_into_another_runs_checkpoint_is_refused(copy, call, extra, why):
    d, before = copy
    proc = call("pretrain", [*TINY, "--train-iters", "4", "--save", d, *[a.format(d=d) for a in extra]])
    refused(proc, f"--save {d} already holds a checkpoint (iteration 2)", why, f"--load {d}",
            "--overwrite-checkpoint")
    assert tree_hash(d) == before


def test_save_that_would_rewind_the_tracker_is_refused(copy, base, call):
    d, _ = copy
    with open(os.path.join(d, TRACKER), "w") as f:  # as if this directory's run had gone on to iteration 9
        f.write("9")
    os.rename(os.path.join(d, "iter_0000002"), os.path.join(d, "iter_0000009"))
    before = tree_hash(d)
    proc = call("pretrain", [*TINY, "--train-iters", "4", "--load", base, "--save", d])
    refused(proc, f"--save {d}", f"--load {base} is at iteration 2", "rewind")
    assert tree_hash(d) == before


def test_overwrite_checkpoint_and_continuing_are_allowed(copy, call):
    d, _ = copy
    proc = call("pretrain", [*TINY, "--train-iters", "3", "--load", d, "--save", d])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert open(os.path.join(d, TRACKER)).read() == "3"
    proc = call("pretrain", [*TINY, "--train-iters", "1", "--save", d, "--overwrite-checkpoint"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert open(os.path.join(d, TRACKER)).read() == "1"
    assert lock_module.LOCK not in os.listdir(d)  # released at exit


# ---- --save that cannot be written -------------------------------------------------------------------


def test_save_onto_a_file_or_under_a_file_is_found_at_start_up(tmp_path, call):
    f = tmp_path / "a_file"
    f.write_text("not a directory")
    refused(call("pretrain", [*TINY, "--train-iters", "2", "--save", str(f)]), f"--save {f} is a file")
    refused(call("pretrain", [*TINY, "--train-iters", "2", "--save", str(f / "sub")]),
            f"--save {f / 'sub'}: cannot create the directory")
    assert f.read_text() == "not a directory"


@pytest.mark.parametrize("code, words", [(errno.EROFS, "Read-only file system"),
                                         (errno.ENOSPC, "No space left on device")])
def test_read_only_or_full_save_directory_is_found_at_start_up(tmp_path, monkeypatch, call, code, words):
    """Tests run as root (a chmod does not stop root), so the probe's write fails by patching."""
    def fail(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(guard.os, "fsync", fail)
    d = str(tmp_path / "ck")
    refused(call("pretrain", [*TINY, "--train-iters", "2", "--save", d]), f"--save {d} is not writable ({words})")
    assert os.listdir(d) == []  # the probe file is gone


FULL_DISK = {"oserror": lambda path: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path),
             # what safetensors raises when the disk fills while it writes: not an OSError
             "safetensors": lambda path: SafetensorError("Error while serializing: I/O error: No space left on "
                                                         "device (os error 28)")}


@pytest.mark.parametrize("kind", FULL_DISK)
def test_save_failing_mid_way_keeps_the_previous_checkpoint(copy, monkeypatch, call, kind):
    """A full disk at the second save: every rank raises, the staging directory is removed and the
    tracker still names iteration 2, byte-identical."""
    from megalite.checkpointing import save as save_module

    d, before = copy
    real = save_module.save_tensors

    def disk_full(tensors, path, metadata=None):
        if "optim_dp" in path:
            raise FULL_DISK[kind](path)
        return real(tensors, path, metadata)

    monkeypatch.setattr(save_module, "save_tensors", disk_full)
    refused(call("pretrain", [*TINY, "--train-iters", "4", "--load", d, "--save", d]),
            f"--save {d}: saving iteration 4 failed on rank 0", "No space left on device",
            f"{os.path.join(d, TRACKER)} still names iteration 2")
    assert not os.path.exists(staging_dir(d, 4)) and tree_hash(d) == before


def test_ctrl_c_during_a_save_is_one_line_and_leaves_no_staging_folder(copy, monkeypatch, call):
    from megalite.checkpointing import save as save_module

    d, before = copy

    def interrupt(tensors, path, metadata=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(save_module, "save_tensors", interrupt)
    proc = call("pretrain", [*TINY, "--train-iters", "4", "--load", d, "--save", d])
    out = refused(proc, "pretrain_gpt.py: error: interrupted (Ctrl-C)")
    assert proc.returncode == 130 and out.count("error:") == 1
    assert tree_hash(d) == before and not [n for n in os.listdir(d) if n.startswith(".")]


def test_a_second_run_into_a_held_save_folder_is_refused_naming_the_first(copy, call):
    """The first run (here: a live process, this test's parent) holds the folder's lock."""
    d, _ = copy
    host, pid = socket.gethostname(), os.getppid()
    owner = lock_module.Owner(host, pid, lock_module._proc_start(pid), "earlier", "x")
    with open(os.path.join(d, lock_module.LOCK), "w") as f:
        json.dump(owner.__dict__, f)
    before = tree_hash(d)
    refused(call("pretrain", [*TINY, "--train-iters", "4", "--load", d, "--save", d]),
            f"--save {d} is in use by another run (host {host}, pid {pid}, started earlier)")
    assert tree_hash(d) == before


# ---- corrupted tensor bytes ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mp_rank_00_000/model.safetensors", "mp_rank_00_000/optim_dp_000.safetensors",
                                  "rng/rank_00000.safetensors"])
def test_flipped_tensor_byte_is_named_on_load(copy, call, name):
    d, _ = copy
    path = os.path.join(d, "iter_0000002", name)
    data = bytearray(open(path, "rb").read())
    data[-5] ^= 0x01  # one bit of the last tensor's bytes: safetensors itself cannot tell
    open(path, "wb").write(bytes(data))
    before = tree_hash(d)
    # --save elsewhere: a run restarting into its own folder would set the damaged checkpoint aside first
    argv = [*TINY, "--train-iters", "4", "--load", d, "--save", os.path.join(os.path.dirname(d), "next")]
    proc = run_pretrain(argv) if name.endswith("model.safetensors") else call("pretrain", argv)  # one as a process
    refused(proc, f"checkpoint file {path} is corrupt or truncated", "metadata.json recorded crc32:")
    assert tree_hash(d) == before
    proc = call("convert", ["reshard", "--load", d, "--save", os.path.join(os.path.dirname(d), "out")])
    if "rng" not in name:  # the tools read weights and optimizer state, not RNG states
        refused(proc, f"checkpoint file {path} is corrupt or truncated")
        assert not os.path.exists(os.path.join(os.path.dirname(d), "out"))


def test_checkpoint_without_checksums_still_loads(copy, call):
    d, _ = copy
    meta_path = os.path.join(d, "iter_0000002", "metadata.json")
    meta = json.load(open(meta_path))
    del meta["checksums"]  # as written before checksums existed
    json.dump(meta, open(meta_path, "w"))
    proc = call("pretrain", [*TINY, "--train-iters", "3", "--load", d])
    assert proc.returncode == 0 and "loaded checkpoint" in proc.stdout, proc.stderr[-3000:]


# ---- offline tools: an existing destination ---------------------------------------------------------


def test_reshard_and_from_hf_refuse_a_non_empty_destination(copy, base, tmp_path, call):
    d, before = copy
    refused(convert("reshard", "--load", base, "--save", d), f"--save {d} exists and is not empty",
            "holds a checkpoint at iteration 2", "--overwrite")
    assert tree_hash(d) == before
    hf = str(tmp_path / "hf")
    assert call("convert", ["to-hf", "--load", base, "--save", hf]).returncode == 0
    refused(call("convert", ["from-hf", "--load", hf, "--save", d]), f"--save {d} exists and is not empty",
            "--overwrite")
    assert tree_hash(d) == before
    f = tmp_path / "a_file"
    f.write_text("x")
    refused(call("convert", ["reshard", "--load", base, "--save", str(f)]), f"--save {f} is a file")
    # --overwrite replaces the whole destination: no later iteration of the old run is left behind
    with open(os.path.join(d, TRACKER), "w") as fh:
        fh.write("9")
    os.rename(os.path.join(d, "iter_0000002"), os.path.join(d, "iter_0000009"))
    assert call("convert", ["from-hf", "--load", hf, "--save", d, "--overwrite"]).returncode == 0
    assert open(os.path.join(d, TRACKER)).read() == "0" and not os.path.exists(os.path.join(d, "iter_0000009"))
    assert not os.path.exists(d + ".incomplete")

