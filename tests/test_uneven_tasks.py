"""Promise (docs/parallelism.md, "Uneven pipeline stages"; docs/tasks.md): tasks/main.py on a checkpoint
saved at an uneven split (10 layers over 4 stages: 1, 3, 3, 3) prints, loaded at that uneven layout and at
TP1/PP1, the numbers of the same weights saved evenly and evaluated in one process."""

from __future__ import annotations

import json
import os
import random

import pytest

from megalite.checkpointing.reshard import reshard
from megalite.parallel.placement import LayerSplit
from tasks.main import run as tasks_run
from tests.harness import run_ranks
from tests.test_generation import bpe_files, write_test_checkpoint
from tests.tp_utils import LLAMA_GQA

MODEL = {**LLAMA_GQA, "num_layers": 10, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
         "seq_length": 32, "max_position_embeddings": 64}
UNEVEN = ["--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "1",
          "--decoder-last-pipeline-num-layers", "3"]
WORDS = "the reader opens a file and returns its lines one per call the parser splits each line into words".split()


def _texts(root: str, ckpt: str, bpe: dict) -> tuple[dict[str, str], int]:
    """A small WIKITEXT103 file; a LAMBADA jsonl whose first lines end in the token the model predicts
    greedily (so some answers are right), then lines ending in a word it does not; how many are right."""
    from megalite.data.tokenizer import GPT2BPETokenizer
    from megalite.inference.generation import generate
    from megalite.inference.loading import load_model, plan
    from megalite.parallel.groups import ProcessGroups

    rng = random.Random(0)
    line = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    wiki, lambada = os.path.join(root, "wiki.test.tokens"), os.path.join(root, "lambada.jsonl")
    with open(wiki, "w") as f:
        f.write(" = Reader = \n" + "".join(f" {line(6, 14)} . \n" for _ in range(8)))
    tok = GPT2BPETokenizer(bpe["vocab_file"], bpe["merge_file"])
    contexts = [line(4, 9) for _ in range(12)]
    single = ProcessGroups.single()
    new = generate(load_model(plan({"load": ckpt}, 1), single), single, [tok.tokenize(c) for c in contexts],
                   1).new_tokens
    texts = [c + tok.detokenize(n) for c, n in zip(contexts, new, strict=True)
             if tok.tokenize(c + tok.detokenize(n)) == tok.tokenize(c) + n][:4]
    known = len(texts)
    texts += [line(5, 12) + " " + w for w in ("file", "lines")]
    with open(lambada, "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return {"WIKITEXT103": wiki, "LAMBADA": lambada}, known


def _argv(env: dict, ckpt: str, task: str) -> list[str]:
    extra = ["--overlapping-eval", "8"] if task == "WIKITEXT103" else []
    return ["--task", task, "--valid-data", env["data"][task], "--load", env[ckpt], "--seq-length", "32",
            "--micro-batch-size", "2", *extra]


def evaluate(argv: list[str]) -> tuple[float, list[str]]:
    """(the result's main number, the printed lines)."""
    lines: list[str] = []
    res = tasks_run(argv, say=lines.append)
    return (res.avg_loss if hasattr(res, "avg_loss") else res.correct), lines


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """The same weights written evenly (PP 2) and resharded to the uneven split (PP 4: 1, 3, 3, 3)."""
    root = str(tmp_path_factory.mktemp("uneven_tasks"))
    bpe = bpe_files(root)
    even = write_test_checkpoint(os.path.join(root, "even"), MODEL, 1, 2, vocab=bpe["vocab_size"], seed=4,
                                 tokenizer=bpe)
    path = reshard(even, os.path.join(root, "uneven"), 1, 4, with_optimizer=False,
                   split=LayerSplit(10, 4, first=1, last=3))
    meta = json.load(open(os.path.join(path, "metadata.json")))["layout"]
    assert meta["chunk_layers"] == [[[0]], [[1, 2, 3]], [[4, 5, 6]], [[7, 8, 9]]], meta
    data, known = _texts(root, even, bpe)
    return {"even": even, "uneven": os.path.dirname(path), "data": data, "known": known}


def _ranks(rank: int, world: int, env: dict) -> dict:
    return {task: evaluate(_argv(env, "uneven", task) + UNEVEN) for task in ("WIKITEXT103", "LAMBADA")}


def test_tasks_on_an_uneven_checkpoint_give_the_even_checkpoints_numbers(env, nccl_semantics):
    want = {task: evaluate(_argv(env, "even", task)) for task in ("WIKITEXT103", "LAMBADA")}
    assert want["WIKITEXT103"][0] > 0 and want["LAMBADA"][0] == env["known"] >= 2, "non-zero numbers to compare"
    serial = {task: evaluate(_argv(env, "uneven", task)) for task in want}
    assert serial == want, "the uneven checkpoint at TP1/PP1"
    results = run_ranks(_ranks, 4, env, timeout=240)
    for task, (value, lines) in results[-1].items():  # the last rank prints
        assert lines == want[task][1], task
        assert value == pytest.approx(want[task][0], rel=1e-6, abs=0), task
    for got in results[:-1]:
        assert all(lines == [] for _, lines in got.values())
