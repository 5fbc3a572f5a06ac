"""Promise: a run trained through pretrain_gpt.py with --eod-mask-loss --reset-position-ids
--reset-attention-mask (and --calculate-per-token-loss) on a real --append-eod corpus trains, validates,
records the flags in its checkpoint's metadata.json, and that checkpoint is evaluated by tasks/main.py
(WIKITEXT103 perplexity) and sampled by tools/generate.py, with the flags repeated on their command line or not."""

from __future__ import annotations

import glob
import json
import math
import os

import pytest

from tasks.main import run as tasks_run
from tests.cli_utils import launch_pretrain, losses
from tests.data_fixtures import eod_corpus, scratch_dir, tiny_bpe
from tests.test_generation import load_tool, one_thread  # noqa: F401 - one_thread is an autouse fixture
from tests.test_tasks_layouts import wiki_text

FLAGS = ["--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("packed"))
    t = tiny_bpe()
    ckpt = os.path.join(root, "ckpt")
    proc = launch_pretrain([
        "--data-path", eod_corpus(), "--vocab-file", t["vocab_file"], "--merge-file", t["merge_file"], "--split",
        "90,10,0", "--data-cache-path", scratch_dir("packed-cache"), "--seq-length", "32", "--max-position-embeddings",
        "32", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "3", "--eval-iters", "1", "--eval-interval", "2",
        "--log-interval", "1", "--lr", "1e-3", "--save", ckpt, "--calculate-per-token-loss", *FLAGS])
    wiki = os.path.join(root, "wiki.test.tokens")
    with open(wiki, "w") as f:
        f.write(wiki_text())
    return {"proc": proc, "ckpt": ckpt, "wiki": wiki}


def test_the_run_trains_validates_and_records_the_flags(trained):
    proc = trained["proc"]
    assert sorted(losses(proc)) == [1, 2, 3]
    assert "validation loss at iteration 2" in proc.stdout and "Traceback" not in proc.stderr
    (meta_path,) = glob.glob(os.path.join(trained["ckpt"], "iter_*", "metadata.json"))
    meta = json.load(open(meta_path))
    assert meta["data"] == {"eod_mask_loss": True, "reset_position_ids": True, "reset_attention_mask": True,
                            "dataloader_inter_document_masking": False}


@pytest.mark.parametrize("repeat_flags", [False, True])
def test_tasks_perplexity_on_the_checkpoint(trained, repeat_flags):
    lines: list[str] = []
    argv = ["--task", "WIKITEXT103", "--valid-data", trained["wiki"], "--load", trained["ckpt"], "--seq-length", "32",
            "--micro-batch-size", "2", *(FLAGS if repeat_flags else [])]
    res = tasks_run(argv, say=lines.append)
    assert math.isfinite(res.avg_loss) and res.ppl > 1
    assert any("ppl" in line.lower() for line in lines)


def test_generate_on_the_checkpoint(trained, tmp_path):
    out = str(tmp_path / "gen.json")
    argv = ["--load", trained["ckpt"], "--greedy", "--ignore-eod", "--max-new-tokens", "6", "--output-json", out,
            "--prompt", "def parse(line):\n", *FLAGS]
    assert load_tool("generate").main(argv) == 0
    (row,) = json.load(open(out))
    assert len(row["tokens"]) == len(row["prompt_tokens"]) + 6
