"""A batch with no unmasked label is named, not reported as a loss of 0 (perplexity 1): a training step says
so once with the flag that masked the labels and logs 'lm loss: none'; a validation over such batches says
so instead of its loss line (per micro-batch and per-token normalisation alike); the tasks refuse a
perplexity or an accuracy over nothing. Resuming past the samples --train-iters x --global-batch-size
provides is one named error, not a traceback at the first batch past the end."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megalite.config.arguments import MegaliteConfig
from megalite.config.model import ModelConfig
from megalite.data.indexed_dataset import IndexedDatasetWriter
from megalite.inference.evaluation import AccuracyResult, PerplexityResult
from megalite.parallel.groups import ProcessGroups
from megalite.training.log import format_validation_line
from megalite.training.train_step import evaluate
from tests.cli_utils import launch_pretrain
from tests.tp_utils import GPT2, build

VOCAB = 64
EOD = VOCAB  # NullTokenizer --vocab-size 64: ids 0..63, the end-of-document token 64


class AllEod:
    """A dataset whose every token is the end-of-document token."""

    def __init__(self, n: int, seq: int, eod: int) -> None:
        self.n, self.seq, self.eod = n, seq, eod

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"text": np.full(self.seq + 1, self.eod, dtype=np.int64)}


@pytest.mark.parametrize("per_token", [False, True])
def test_evaluation_over_no_unmasked_token_has_no_loss(per_token):
    cfg = MegaliteConfig()
    cfg.training.calculate_per_token_loss = per_token
    cfg.data.eod_mask_loss = True
    cfg.training.global_batch_size, cfg.training.micro_batch_size, cfg.training.eval_iters = 4, 2, 2
    cfg.model = ModelConfig(**GPT2)
    chunk = build(ModelConfig(**GPT2), ProcessGroups.single(), VOCAB + 1).eval()
    got = evaluate([chunk], AllEod(16, GPT2["seq_length"], EOD), 0, cfg, ProcessGroups.single(), EOD)
    assert got is None, f"a loss of {got} over no unmasked token"


def test_the_validation_line_names_the_flag_instead_of_a_perplexity_of_one():
    line = format_validation_line(7, None, why="--eod-mask-loss masks every label")
    assert "no unmasked token" in line and "--eod-mask-loss" in line and "PPL" not in line
    assert "lm loss PPL: 1.000000E+00" not in line
    assert "lm loss value: 2.500000E+00" in format_validation_line(7, 2.5)


def test_tasks_refuse_a_perplexity_or_an_accuracy_over_nothing():
    with pytest.raises(ValueError, match="no target"):
        PerplexityResult(0.0, 1, 1, 1).avg_loss  # noqa: B018
    with pytest.raises(ValueError, match="no example"):
        AccuracyResult(0.0, 0).accuracy  # noqa: B018
    assert math.isclose(PerplexityResult(4.0, 3, 3, 1).avg_loss, 2.0)


# ---- through pretrain_gpt.py -------------------------------------------------------------------------------

TINY = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--num-layers", "1", "--hidden-size", "16",
        "--num-attention-heads", "2", "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1",
        "--log-interval", "1", "--lr", "1e-3"]


def _indexed(prefix: str, token: int | None) -> str:
    """40 documents of 20 tokens: every one ``token``, or (None) varied ids below the vocabulary."""
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for i in range(40):
            w.add_document(np.full(20, token, np.int32) if token is not None else (np.arange(20) + i) % VOCAB)
        w.finalize()
    return prefix


def test_a_run_on_all_eod_data_with_eod_mask_loss_says_so_once(tmp_path):
    data = _indexed(str(tmp_path / "eod"), EOD)
    proc = launch_pretrain(["--data-path", data, "--split", "9,1,0", *TINY, "--global-batch-size", "2",
                            "--train-iters", "3", "--eval-iters", "1", "--eval-interval", "2", "--eod-mask-loss"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    warnings = [line for line in out.splitlines() if "no unmasked token in the global batch" in line]
    assert len(warnings) == 1 and "--eod-mask-loss" in warnings[0], out[-3000:]
    assert "lm loss: 0.000000E+00" not in out and out.count("lm loss: none (no unmasked token)") == 3, out[-3000:]
    valid = [line for line in out.splitlines() if "validation loss at iteration" in line]
    assert len(valid) == 2 and all("no unmasked token" in v and "--eod-mask-loss" in v for v in valid), valid
    assert "PPL: 1.000000E+00" not in out


def test_resuming_past_the_samples_the_flags_provide_is_named(tmp_path):
    data, ck = _indexed(str(tmp_path / "d"), None), str(tmp_path / "ck")
    base = ["--data-path", data, "--split", "1,0,0", *TINY, "--eval-iters", "0", "--save", ck, "--load", ck]
    first = launch_pretrain([*base, "--global-batch-size", "8", "--train-iters", "12"])
    assert first.returncode == 0, first.stderr[-3000:]
    # 96 samples consumed; at a global batch of 1, --train-iters 20 sizes the training set for 20 samples
    proc = launch_pretrain([*base, "--global-batch-size", "1", "--train-iters", "20"])
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert "96 training samples consumed" in err and "--train-iters 20" in err and "--global-batch-size 1" in err, err
