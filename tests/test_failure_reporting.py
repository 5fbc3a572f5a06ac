"""Failures of multi-rank runs read as errors: printed once, by the first failing rank and naming it; the
other ranks leave at once, silently and non-zero; ranks that never met are named within
--distributed-timeout-minutes; a bug keeps its traceback. Also the flags that act on memory between steps
(--manual-gc, --empty-unused-memory-level, counted through their calls) and the refusal to save a
non-finite optimizer state."""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist

from megalite import device
from megalite.checkpointing.save import CheckpointSaveError, save_checkpoint
from megalite.config import validate
from megalite.config.arguments import MegaliteConfig
from megalite.launch.failure import FailureBoard
from megalite.launch.rendezvous import Rendezvous
from megalite.parallel.groups import ProcessGroups
from megalite.training import manual_gc
from megalite.training.loop import pretrain
from tests.cli_utils import ROOT, launch_pretrain, run_pretrain
from tests.harness import free_port
from tests.test_bad_input_data import TINY, _failed
from tests.tp_utils import mock_data

ARGS = [*TINY, "--mock-data", "--global-batch-size", "4", "--eval-iters", "0"]
ERROR = "pretrain_gpt.py: error:"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A 2-rank (DP=2) checkpoint at iteration 1: one RNG file per rank, read by that rank only."""
    save = str(tmp_path_factory.mktemp("ck") / "ck")
    proc = run_pretrain([*ARGS, "--train-iters", "1", "--save", save], nproc=2, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return save


def _corrupt_rng(saved: str, tmp_path, rank: int) -> tuple[str, str]:
    """A copy of ``saved`` whose RNG file of ``rank`` is damaged; (directory, that file)."""
    ck = str(tmp_path / "ck")
    shutil.copytree(saved, ck)
    path = os.path.join(ck, "iter_0000001", "rng", f"rank_{rank:05d}.safetensors")
    with open(path, "r+b") as f:
        f.write(b"garbage")
    return ck, path


def _start(ranks: list[int], args: list[str]) -> dict[int, subprocess.Popen]:
    """Ranks of a world of 2 started without a launcher (only ``ranks`` of them), as a user would."""
    port = str(free_port())
    procs = {}
    for r in ranks:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "RANK": str(r), "LOCAL_RANK": str(r),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs[r] = subprocess.Popen([sys.executable, str(ROOT / "pretrain_gpt.py"), *args], cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return procs


def _finish(procs: dict[int, subprocess.Popen]) -> dict[int, subprocess.CompletedProcess]:
    out = {}
    for r, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        out[r] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


def test_a_failure_on_one_rank_is_printed_once_by_that_rank(saved, tmp_path):
    ck, path = _corrupt_rng(saved, tmp_path, rank=1)  # rank 0 reads only its own file and goes on
    # --save elsewhere: a run restarting into its own folder would set the damaged checkpoint aside first
    proc = run_pretrain([*ARGS, "--train-iters", "3", "--load", ck, "--save", str(tmp_path / "next")], nproc=2,
                        timeout=120)
    stderr = _failed(proc, f"{ERROR} rank 1: checkpoint file {path} is corrupt", launcher=True)
    assert stderr.count(ERROR) == 1, stderr[-3000:]
    assert "Connection closed" not in stderr  # rank 0's echo of rank 1 leaving is not reported
    assert open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read().strip() == "1"


def test_without_a_launcher_the_other_rank_leaves_silently(saved, tmp_path):
    ck, path = _corrupt_rng(saved, tmp_path, rank=0)  # rank 0 also hosts the rendezvous store
    out = _finish(_start([0, 1], [*ARGS, "--train-iters", "3", "--load", ck]))
    assert out[0].returncode == 2 and out[1].returncode != 0
    _failed(out[0], f"{ERROR} rank 0: checkpoint file {path} is corrupt")
    assert out[1].stderr.strip() == "", out[1].stderr[-3000:]


def test_ranks_that_never_joined_are_named_within_the_timeout():
    args = [*ARGS, "--train-iters", "1", "--distributed-timeout-minutes", "0.05"]
    rank0, rank1 = _start([0], args), _start([1], args)  # each in a world of its own
    alone = {**_finish(rank0), **_finish(rank1)}
    _failed(alone[0], f"{ERROR} rank 0: rank(s) 1 of 2 never joined within 0.05 min (--distributed-timeout-minutes)")
    _failed(alone[1], f"{ERROR} rank 1: rank 0, which hosts the rendezvous store at 127.0.0.1:", "never joined "
            "within 0.05 min")


def test_a_collapsed_fp16_loss_scale_is_one_error_line():
    proc = launch_pretrain([*ARGS, "--global-batch-size", "2", "--train-iters", "50", "--fp16", "--lr", "1e30",
                            "--initial-loss-scale", "1", "--min-loss-scale", "1", "--loss-scale-collapse-iters", "3",
                            "--no-check-for-nan-in-loss-and-grad"])
    _failed(proc, f"{ERROR} fp16 loss scale collapsed: 3 consecutive iterations overflowed")
    assert proc.returncode == 2


def _boards(timeout_s: float = 0.5) -> tuple[FailureBoard, FailureBoard]:
    """Two ranks' boards over one in-process store (not watched: a watcher would end this process)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    host = dist.TCPStore("127.0.0.1", free_port(), 2, is_master=True, timeout=timeout, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", host.port, 2, is_master=False, timeout=timeout)
    boards = []
    for rank, store in enumerate([host, client]):
        board = FailureBoard("prog", rank, 2, timeout)
        board.rv = Rendezvous(dist.PrefixStore("run", store), rank == 0, "here")
        boards.append(board)
    return boards[0], boards[1]


def test_a_bug_keeps_its_traceback_and_its_echo_on_a_peer_is_silent(capsys):
    first, peer = _boards()
    with pytest.raises(KeyError, match="a bug"), first.reporting((ValueError,)):
        raise KeyError("a bug")
    with peer.reporting((ValueError,)):
        raise RuntimeError("Connection closed by peer")  # what a collective raises once the bug's rank left
    assert peer.exit_code == 1 and capsys.readouterr().err == ""


def test_an_expected_error_on_every_rank_is_printed_once(capsys):
    boards = _boards()
    for board in boards:
        with board.reporting((ValueError,)):
            raise ValueError(f"bad input seen by rank {board.rank}")
    assert [b.exit_code for b in boards] == [2, 2]
    assert capsys.readouterr().err == "prog: error: rank 0: bad input seen by rank 0\n"


# In-process single-rank runs: what the memory flags call, and when.

VOCAB = 64


def _run(iters: int, **extra) -> None:
    cfg = MegaliteConfig.from_flat(dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8,
                                        micro_batch_size=2, global_batch_size=2, train_iters=iters, lr=1e-3,
                                        log_interval=100, mock_data=True, vocab_size=VOCAB, **extra))
    validate(cfg, 1)
    return pretrain(cfg, ProcessGroups.single(), data=mock_data(VOCAB, 8, 1234, 64), log=lambda s: None)


@pytest.fixture
def gc_calls(monkeypatch) -> list[str]:
    calls: list[str] = []
    fake = types.SimpleNamespace(collect=lambda generation=2: calls.append(f"collect{generation}"),
                                 disable=lambda: calls.append("disable"), enable=lambda: calls.append("enable"),
                                 isenabled=lambda: True)
    monkeypatch.setattr(manual_gc, "gc", fake)
    return calls


def test_manual_gc_collects_at_the_start_every_interval_and_around_evaluations(gc_calls):
    _run(6, manual_gc=True, manual_gc_interval=2, eval_interval=3, eval_iters=1)
    eval_ = ["collect2", "collect0"]  # a full collection before, the young generation after
    # start | step 2 | eval at 3 | step 4 | step 6 | the final evaluation | collector back on
    assert gc_calls == ["disable", "collect2", "collect2", *eval_, "collect2", "collect2", *eval_, "enable"]


def test_manual_gc_variants(gc_calls):
    _run(4, manual_gc=True, eval_interval=2, eval_iters=1, manual_gc_eval=False)  # interval 0: start only
    assert gc_calls == ["disable", "collect2", "enable"]
    gc_calls.clear()
    _run(4, manual_gc_interval=1, eval_interval=2, eval_iters=1)  # without --manual-gc nothing is touched
    assert gc_calls == []


@pytest.mark.parametrize("level,expected", [(0, 0), (1, 3 + 4), (2, 3 + 4 + 3)])
def test_empty_unused_memory_level(monkeypatch, level, expected):
    calls = []
    monkeypatch.setattr(device, "empty_cache", lambda: calls.append(1))
    # 3 steps; evaluations after step 2 and at the end, 2 batches each
    _run(3, empty_unused_memory_level=level, eval_interval=2, eval_iters=2)
    assert len(calls) == expected  # 1: after each forward-backward (train and eval); 2: + after each step


def test_a_non_finite_optimizer_state_is_never_saved(tmp_path):
    result = _run(1, eval_iters=0)
    slices, _ = result.optimizer.state_tensors()
    slices[-1].tensors["exp_avg_sq"].view(-1)[0] = float("inf")  # the weights stay finite
    assert all(torch.isfinite(p).all() for c in result.chunks for p in c.parameters())
    with pytest.raises(CheckpointSaveError, match=r"refusing to save iteration 1: optimizer state \S+/exp_avg_sq "
                       r"on rank 0 is not finite \(NaN/inf\); nothing was written"):
        save_checkpoint(str(tmp_path / "ck"), 1, result.chunks, result.optimizer, ProcessGroups.single(), {}, {}, {})
    assert not os.path.exists(tmp_path / "ck")
