"""Promises of tasks/main.py on real checkpoints (GPT-2 style with tied embeddings, Llama style with GQA):
- WIKITEXT103 perplexity equals transformers' on the to-hf export over the same tokens and windows
  (rel <= 1e-4), and LAMBADA accuracy equals transformers' greedy predictions;
- on a model whose greedy continuations make up part of the LAMBADA file, the accuracy is known;
- at TP=2 PP=2 (and PP=2 with virtual stages x DP=2, and DP=4) both tasks print the single-process lines;
- bad input is refused by name before any process group exists.
Text files and tokenizers are made here; nothing is downloaded."""

from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch

from megalite.inference.evaluation import count_words, lm_windows, wikitext_detokenize
from megalite.inference.generation import generate
from megalite.inference.loading import load_model, plan
from megalite.parallel.groups import ProcessGroups
from tasks.main import main as tasks_main
from tasks.main import run as tasks_run
from tests.harness import run_ranks
from tests.test_generation import (  # noqa: F401 - one_thread is an autouse fixture
    MODELS,
    bpe_files,
    load_tool,
    one_thread,
    write_test_checkpoint,
)

SEQ, OVERLAP, MBS = "32", "8", "3"
WORDS = ("the reader opens a file and returns its lines , one per call ; the parser splits each line into "
         "words , keeping 1 @,@ 000 @-@ long fields and dates like 1 @.@ 5").split()
QUIET = lambda s: None  # noqa: E731


def wiki_text(n_lines: int = 12) -> str:
    rng = random.Random(0)
    lines = [" = Reader = \n"] + [" " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) + " . \n"
                                  for _ in range(n_lines)]
    return "".join(lines)


def word_tokens(tok) -> list[int]:
    """Tokens that are a space and a whole word (" line")."""
    return [i for i in range(tok.vocab_size) if tok.detokenize([i])[:1] == " " and tok.detokenize([i])[1:].isalpha()]


def lambada_texts(ckpt: str, tok) -> tuple[list[str], int]:
    """Contexts followed by the word the model predicts greedily (correct in plain and strict mode, when
    the word is one token that tokenizes the same alone and after the context), then lines of the
    training-like text ending in a word it does not predict (almost surely wrong)."""
    p = plan({"load": ckpt}, 1)
    chunks = load_model(p, ProcessGroups.single())
    rng = random.Random(1)
    contexts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))) for _ in range(40)]
    words = word_tokens(tok)
    predicted = generate(chunks, ProcessGroups.single(), [tok.tokenize(c) for c in contexts], 1).new_tokens
    texts = []
    for context, new in zip(contexts, predicted):
        word = tok.detokenize(new)
        ids = tok.tokenize(context + word)
        if new[0] in words and ids == tok.tokenize(context) + new and len(ids) <= int(SEQ) + 1 and len(texts) < 6:
            texts.append(context + word)
    known = len(texts)
    texts += [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))) + " " + w for w in ("file", "lines",
                                                                                                 "words", "dates")]
    return texts, known


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    from megalite.data.tokenizer import GPT2BPETokenizer

    root = str(tmp_path_factory.mktemp("tasks"))
    bpe = bpe_files(root)
    tok = GPT2BPETokenizer(bpe["vocab_file"], bpe["merge_file"])
    words = word_tokens(tok)

    def prefer_words(model):  # the Llama model (untied) picks whole words more often: strict LAMBADA has hits
        if model.output_layer is not None:
            model.output_layer.weight[words] *= 4

    ckpts = {name: write_test_checkpoint(os.path.join(root, name), flags, 2, 2, vocab=bpe["vocab_size"], seed=4,
                                         tokenizer=bpe, edit=prefer_words) for name, flags in MODELS.items()}
    wiki = os.path.join(root, "wiki.test.tokens")
    with open(wiki, "w") as f:
        f.write(wiki_text())
    lambada = os.path.join(root, "lambada.jsonl")
    texts, known = lambada_texts(ckpts["llama_gqa"], tok)
    with open(lambada, "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return {"root": root, "bpe": bpe, "tok": tok, "ckpts": ckpts, "wiki": wiki, "lambada": lambada,
            "known_correct": known, "lambada_size": len(texts)}


def task_argv(env: dict, model: str, task: str) -> list[str]:
    common = ["--load", env["ckpts"][model], "--seq-length", SEQ, "--micro-batch-size", MBS]
    if task == "WIKITEXT103":
        return ["--task", task, "--valid-data", env["wiki"], "--overlapping-eval", OVERLAP, *common]
    if task == "LAMBADA":
        return ["--task", task, "--valid-data", env["lambada"], *common]
    return ["--task", "LAMBADA", "--valid-data", env["lambada"], "--strict-lambada", *common]  # LAMBADA_STRICT


def evaluate(argv: list[str]) -> tuple[float, list[str]]:
    """(the result's main number, the printed lines)."""
    lines: list[str] = []
    res = tasks_run(argv, say=lines.append)
    return (res.avg_loss if hasattr(res, "avg_loss") else res.correct), lines


# ---- against transformers ---------------------------------------------------------------------------------


def hf_model(env: dict, name: str, tmp_path):
    import transformers

    out = str(tmp_path / f"hf_{name}")
    assert load_tool("convert_checkpoint").main(["to-hf", "--load", env["ckpts"][name], "--save", out]) == 0
    cls = "GPT2LMHeadModel" if name == "gpt2" else "LlamaForCausalLM"
    return getattr(transformers, cls).from_pretrained(out, local_files_only=True).eval()


@pytest.mark.parametrize("name", MODELS)
def test_perplexity_equals_transformers_on_the_to_hf_export(env, tmp_path, name):
    hf = hf_model(env, name, tmp_path)
    text = open(env["wiki"]).read()
    tokens = env["tok"].tokenize(wikitext_detokenize(text))  # the file name says wiki: detokenized first
    total = 0.0
    for w in lm_windows(tokens, int(SEQ), int(OVERLAP)):
        ids = torch.tensor([w.tokens])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids[:, :-1]).logits.double(), dim=-1)[0]
        total -= sum(logp[j, w.tokens[j + 1]].item() for j in w.scored)
    want_loss = total / (len(tokens) - 1)
    # Explicit tokenizer flags (instead of the checkpoint's record) give the same tokens.
    bpe = env["bpe"]
    argv = task_argv(env, name, "WIKITEXT103") + ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                                                  bpe["vocab_file"], "--merge-file", bpe["merge_file"]]
    res = tasks_run(argv, say=QUIET)
    assert res.num_tokenized_tokens == len(tokens) and res.num_original_tokens == count_words(text)
    assert res.avg_loss == pytest.approx(want_loss, rel=1e-4)
    assert res.ppl == pytest.approx(math.exp(want_loss), rel=1e-4)
    assert abs(math.log(res.ppl / bpe["vocab_size"])) > 0.05, "too close to uniform for the check to mean much"
    ratio = (len(tokens) - 1) / (count_words(text) - 1)
    assert res.adjusted_ppl == pytest.approx(math.exp(want_loss * ratio), rel=1e-4)


def test_lambada_accuracy_equals_transformers_and_the_known_answer(env, tmp_path):
    hf = hf_model(env, "llama_gqa", tmp_path)
    tok = env["tok"]
    for strict in (False, True):
        correct = 0
        for line in open(env["lambada"]):
            text = json.loads(line)["text"]
            if strict:
                word = text.split()[-1]
                context, target = tok.tokenize(text[: text.rfind(word)].strip()), tok.tokenize(" " + word)
            else:
                ids = tok.tokenize(text)
                context, target = ids[:-1], ids[-1:]
            ids = torch.tensor([(context + target)[-(int(SEQ) + 1):]])  # a long context keeps its end
            with torch.no_grad():
                pred = hf(ids[:, :-1]).logits[0].argmax(-1)[-len(target):].tolist()
            correct += pred == target
        argv = task_argv(env, "llama_gqa", "LAMBADA_STRICT" if strict else "LAMBADA")
        res = tasks_run(argv, say=QUIET)
        assert (res.correct, res.total) == (correct, env["lambada_size"]), strict
        assert res.correct == env["known_correct"] >= 4, strict


# ---- layouts ---------------------------------------------------------------------------------------------

LAYOUTS = {"tp2_pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
           "pp2_vp2_dp2": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
           "dp4": []}
PLAN = [("llama_gqa", "WIKITEXT103", "tp2_pp2"), ("llama_gqa", "LAMBADA", "tp2_pp2"),
        ("llama_gqa", "LAMBADA_STRICT", "tp2_pp2"), ("gpt2", "WIKITEXT103", "tp2_pp2"),
        ("llama_gqa", "WIKITEXT103", "pp2_vp2_dp2"), ("llama_gqa", "LAMBADA", "dp4")]


def _layout_ranks(rank: int, world: int, env: dict) -> dict:
    return {(m, t, layout): evaluate(task_argv(env, m, t) + LAYOUTS[layout]) for m, t, layout in PLAN}


def test_both_tasks_print_the_single_process_numbers_at_tp2_pp2_and_other_layouts(env, nccl_semantics):
    want = {(m, t): evaluate(task_argv(env, m, t)) for m, t, _ in PLAN}
    assert all(v > 0 for v, _ in want.values()), "non-zero numbers, so equality means something"
    env_small = {k: v for k, v in env.items() if k != "tok"}
    results = run_ranks(_layout_ranks, 4, env_small, timeout=240)
    for (m, t, layout), (value, lines) in results[-1].items():  # the last rank prints
        want_value, want_lines = want[(m, t)]
        assert lines == want_lines, (m, t, layout)
        assert value == pytest.approx(want_value, rel=1e-6, abs=0), (m, t, layout)
    for rank, got in enumerate(results[:-1]):  # every rank returns the numbers; only the last prints
        for key, (value, lines) in got.items():
            assert lines == [] and value == pytest.approx(want[key[:2]][0], rel=1e-6), (rank, key)


# ---- bad input -----------------------------------------------------------------------------------------------


def test_bad_input_is_refused_by_name(env, tmp_path, capsys):
    base = task_argv(env, "gpt2", "WIKITEXT103")
    cases = [
        (base + ["--hidden-size", "48"], "--hidden-size: checkpoint 32, flags 48"),
        (base + ["--overlapping-eval", "40"], "--overlapping-eval (40) must be in [1, --seq-length (32)]"),
        (base + ["--seq-length", "128"], "--seq-length (128) must be <= the checkpoint's --max-position-embeddings"),
        (base + ["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size (3) must divide"),
        (["--task", "LAMBADA", "--valid-data", str(tmp_path / "nope.jsonl"), "--load", env["ckpts"]["gpt2"]],
         "nope.jsonl: no such file"),
        (["--task", "LAMBADA", "--valid-data", env["wiki"], "--load", str(tmp_path)], f"--load {tmp_path}"),
    ]
    for argv, message in cases:
        assert tasks_main(argv) == 2, message
        assert message in capsys.readouterr().err
