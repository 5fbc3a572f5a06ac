"""Runs that would go silently wrong stop with one named error through the real pretrain_gpt.py: a loss
or weights that are no longer finite, and token ids the vocabulary does not cover."""

from __future__ import annotations

import os

from tests.cli_utils import run_pretrain

TINY = ["--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "2", "--log-interval", "1"]


def _failed(proc, *named: str) -> str:
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback (most recent call last)" not in proc.stderr, proc.stderr[-3000:]
    for text in named:
        assert text in proc.stderr, f"{text!r} not in:\n{proc.stderr[-3000:]}"
    return proc.stderr


def test_diverged_loss_stops_by_default_before_saving(tmp_path):
    save = str(tmp_path / "ck")
    proc = run_pretrain(["--mock-data", *TINY, "--train-iters", "4", "--lr", "1e30", "--save", save,
                         "--save-interval", "2"])
    _failed(proc, "is not finite at iteration 2", "--no-check-for-nan-in-loss-and-grad")
    assert not os.path.exists(os.path.join(save, "latest_checkpointed_iteration.txt"))
    assert not [d for d in os.listdir(save) if d.startswith("iter_")] if os.path.isdir(save) else True


def test_non_finite_weights_are_never_saved(tmp_path):
    save = str(tmp_path / "ck")
    proc = run_pretrain(["--mock-data", *TINY, "--train-iters", "3", "--lr", "1e30", "--save", save,
                         "--no-check-for-nan-in-loss-and-grad"])
    _failed(proc, "refusing to save iteration 3: parameter ", "is not finite")
    assert not os.path.exists(os.path.join(save, "latest_checkpointed_iteration.txt"))
