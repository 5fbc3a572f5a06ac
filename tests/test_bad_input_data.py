"""Runs that would go silently wrong stop with one named error through the real pretrain_gpt.py: a loss
or weights that are no longer finite, and token ids the vocabulary does not cover."""

from __future__ import annotations

import os

from tests.cli_utils import ROOT, launch_pretrain, losses, run_pretrain
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
    launch = run_pretrain if nproc > 1 else launch_pretrain  # several ranks: torchrun's, as the message is for
    return launch(["--data-path", prefix, "--split", "1,0,0", "--tokenizer-type", "NullTokenizer",
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


# ---- data and task files checked before use, each failure naming file and line (issue 25, classes 5, 6) -------
# In-process: the readers are called directly (no run is started).


def test_index_of_another_dtype_beside_a_bin_is_named(tmp_path):
    import shutil

    import numpy as np

    from megalite.data.errors import CorruptDatasetError
    from megalite.data.indexed_dataset import IndexedDataset

    a, b = str(tmp_path / "u16"), str(tmp_path / "i32")
    random_indexed(a, 5, seed=3, dtype=np.uint16)
    random_indexed(b, 5, seed=3, dtype=np.int32)  # the same documents, 4-byte tokens
    shutil.copy(b + ".idx", a + ".idx")
    try:
        IndexedDataset(a)
    except CorruptDatasetError as e:
        msg = str(e)
    else:
        raise AssertionError("a .bin of uint16 tokens opened with an int32 index")
    assert f"the index {a}.idx says int32 tokens" in msg and "uint16" in msg and "different token dtypes" in msg, msg
    assert "truncated" not in msg, msg


def _lambada_error(tmp_path, text: str) -> str:
    from megalite.inference.evaluation import read_lambada

    path = tmp_path / "lambada.jsonl"
    path.write_text(text)
    try:
        read_lambada(str(path))
    except ValueError as e:
        return str(e).replace(str(path), "{path}")
    raise AssertionError(f"accepted {text!r}")


def test_lambada_line_whose_text_is_not_a_string_is_named(tmp_path):
    good = '{"text": "the cat sat"}\n'
    expected = "{path}:2: 'text' must be a non-empty string, got int '42'"
    assert _lambada_error(tmp_path, good + '{"text": 42}\n') == expected
    assert "{path}:2: 'text' must be a non-empty string, got list" in _lambada_error(tmp_path, good + '{"text": [1]}\n')
    assert "{path}:1: 'text' must be a non-empty string, got str ''" in _lambada_error(tmp_path, '{"text": ""}\n')
    assert "{path}:2: expected a JSON object with a 'text' field, got list" in _lambada_error(tmp_path, good + "[1]\n")
    assert "key 'text' is written twice" in _lambada_error(tmp_path, '{"text": "a b", "text": "c d"}\n')


def test_empty_prompts_file_is_named(tmp_path):
    from types import SimpleNamespace

    from megalite.config.validate import ConfigError
    from tests.cli_utils import load_tool

    path = tmp_path / "prompts.txt"
    path.write_text("\n  \n")
    try:
        load_tool("generate")._prompts(SimpleNamespace(prompt=[], prompts_file=str(path)))
    except ConfigError as e:
        assert f"--prompts-file {path} is empty" in str(e), e
    else:
        raise AssertionError("an empty prompts file was accepted")


def test_vocab_json_with_a_token_twice_is_named(tmp_path):
    from megalite.data.errors import TokenizerError
    from megalite.data.tokenizer import _read_bpe_vocab

    path = tmp_path / "vocab.json"
    path.write_text('{"a": 0,\n "b": 1,\n "a": 2}')
    try:
        _read_bpe_vocab(str(path))
    except TokenizerError as e:
        assert f"--vocab-file {path}: key 'a' is written twice (lines 1 and 3)" in str(e), e
    else:
        raise AssertionError("a vocab.json naming one token twice was accepted")
