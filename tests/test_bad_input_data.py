"""Runs that would go silently wrong stop with one named error through the real pretrain_gpt.py: a loss
or weights that are no longer finite, and token ids the vocabulary does not cover."""

from __future__ import annotations

import os

from tests.cli_utils import ROOT, launch_pretrain, losses
from tests.data_fixtures import random_indexed

TINY = ["--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "2", "--log-interval", "1"]


def _failed(proc, *named: str, launcher: bool = False) -> str:
    """stderr of a failed run that named ``named`` without a traceback (under torchrun, the launcher's
    own report of a failed child is allowed, but no frame of the training code)."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    if launcher:
        assert f'File "{ROOT / "megalite"}' not in proc.stderr and "pretrain_gpt.py\", line" not in proc.stderr, \
            proc.stderr[-3000:]
    else:
        assert "Traceback (most recent call last)" not in proc.stderr, proc.stderr[-3000:]
    for text in named:
        assert text in proc.stderr, f"{text!r} not in:\n{proc.stderr[-3000:]}"
    return proc.stderr


def test_diverged_loss_stops_by_default_before_saving(tmp_path):
    save = str(tmp_path / "ck")
    proc = launch_pretrain(["--mock-data", *TINY, "--train-iters", "4", "--lr", "1e30", "--save", save,
                         "--save-interval", "2"])
    _failed(proc, "is not finite at iteration 2", "--no-check-for-nan-in-loss-and-grad")
    assert not os.path.exists(os.path.join(save, "latest_checkpointed_iteration.txt"))
    assert not [d for d in os.listdir(save) if d.startswith("iter_")] if os.path.isdir(save) else True


def test_non_finite_weights_are_never_saved(tmp_path):
    save = str(tmp_path / "ck")
    proc = launch_pretrain(["--mock-data", *TINY, "--train-iters", "3", "--lr", "1e30", "--save", save,
                         "--no-check-for-nan-in-loss-and-grad"])
    _failed(proc, "refusing to save iteration 3: parameter ", "is not finite")
    assert not os.path.exists(os.path.join(save, "latest_checkpointed_iteration.txt"))


def _data(tmp_path, vocab: int, name: str = "corpus") -> str:
    prefix = str(tmp_path / name)
    random_indexed(prefix, 40, seed=0, max_len=30, vocab=vocab)
    return prefix


def _run_on(prefix: str, vocab: int, *extra: str, nproc: int = 1):
    return launch_pretrain(["--data-path", prefix, "--split", "1,0,0", "--tokenizer-type", "NullTokenizer",
                         "--vocab-size", str(vocab), *TINY[2:], "--train-iters", "2", "--eval-iters", "0", *extra],
                        nproc=nproc)


def test_token_ids_past_the_vocab_are_named_on_every_rank(tmp_path):
    prefix = _data(tmp_path, vocab=1000)  # ids up to 999; NullTokenizer 64 covers 0..64
    proc = _run_on(prefix, 64, "--global-batch-size", "4", nproc=2)
    stderr = _failed(proc, f"{prefix}.bin holds token id ", "vocab size is 65", launcher=True)
    assert stderr.count("holds token id") == 1  # both ranks stop; the first to fail says why, once
    top = max(int(d.max()) for d in random_indexed(str(tmp_path / "again"), 40, seed=0, max_len=30, vocab=1000))
    assert f"token id {top}," in stderr


def test_token_ids_in_the_padding_are_caught(tmp_path):
    # 128 is a multiple of the padding divisor: vocab 65 pads to 128, so ids 65..99 are padding rows.
    prefix = _data(tmp_path, vocab=100)
    _failed(_run_on(prefix, 64), "vocab size is 65")
    losses(_run_on(prefix, 99))  # a tokenizer that covers the ids trains (and reads the cached maximum)
