"""Promises of the LAMBADA task (megalite/inference/evaluation.py, Megatron's scoring rules):
- plain mode: the target is the text's last token; --strict-lambada: the whole last word, tokenized as
  " word" after the context (the text before it, stripped) is tokenized on its own;
- an example counts only if the greedy prediction is right at every target position;
- on a model whose prediction is known (always the same token) the accuracy is known, whatever the
  micro-batch size; a context longer than --seq-length keeps its end; bad files are named."""

from __future__ import annotations

import json

import pytest
import torch

from megalite.data.tokenizer import NullTokenizer
from megalite.inference.evaluation import cloze_correct, evaluate_lambada, lambada_example, read_lambada
from megalite.parallel.groups import ProcessGroups
from tests.test_generation import one_thread  # noqa: F401 - autouse fixture
from tests.test_tasks_perplexity import VOCAB, _zero_model


def chars(text: str) -> list[int]:
    """A character-level 'tokenizer': one id per character, so words span several tokens."""
    return [ord(c) for c in text]


def decode(ids) -> str:
    return "".join(chr(i) for i in ids)


def test_plain_mode_target_is_the_last_token_only():
    ex = lambada_example("she opened the door", chars, strict=False, seq_length=64)
    assert decode(ex.tokens) == "she opened the door"
    scored = [ex.tokens[j + 1] for j in ex.scored]
    assert decode(scored) == "r"  # the last token, not the word


def test_strict_mode_target_is_the_whole_last_word_with_its_space():
    ex = lambada_example("she opened the door ", chars, strict=True, seq_length=64)
    scored = [ex.tokens[j + 1] for j in ex.scored]
    assert decode(scored) == " door"
    assert decode(ex.tokens) == "she opened the door"  # context stripped, then " door"
    # The word's last occurrence is the target even when it also appears earlier.
    ex = lambada_example("door to door", chars, strict=True, seq_length=64)
    assert decode(ex.tokens[: ex.scored.start + 1]) == "door to"


def test_long_context_keeps_its_end():
    ex = lambada_example("a b c d e f g h", chars, strict=True, seq_length=6)
    assert len(ex.tokens) == 7 and decode(ex.tokens) == "e f g h"
    assert decode([ex.tokens[j + 1] for j in ex.scored]) == " h"


def test_an_example_is_correct_only_if_every_target_token_is():
    labels = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    mask = torch.tensor([[False, False, True, True]] * 3)
    preds = torch.tensor([[9, 9, 3, 4],    # context wrong, target right -> correct
                          [1, 2, 3, 9],    # last target token wrong -> wrong
                          [1, 2, 9, 4]])   # first target token wrong -> wrong
    assert cloze_correct(preds, labels, mask).tolist() == [1.0, 0.0, 0.0]


def test_accuracy_of_a_model_that_always_predicts_the_same_token():
    """Zero weights except the output: logits W b are the same at every position, argmax = token 7."""
    model = _zero_model(untied=True)
    with torch.no_grad():
        model.final_norm.bias.fill_(1.0)
        model.output_layer.weight.zero_()
        model.output_layer.weight[7].fill_(1.0)
    tok = NullTokenizer(VOCAB - 1)
    texts = ["1 2 3 7", "4 7 7 8", "7 7", "5 6 7 9 7", "3 3 3 3 3 3 3 3 3 3 3 3 3 3 3 3 3 3 3 3 7", "2 9"]
    for strict in (False, True):
        examples = [lambada_example(t, tok.tokenize, strict, seq_length=16) for t in texts]
        for mbs in (1, 4):
            res = evaluate_lambada([model], ProcessGroups.single(), examples, mbs, pad=tok.eod)
            assert (res.correct, res.total) == (4.0, 6)
            assert res.accuracy == pytest.approx(4 / 6)
    assert res.line("LAMBADA") == (" validation results on LAMBADA | number correct: 4.0000E+00 | total examples: "
                                   "6.0000E+00 | avg accuracy: 6.6667E-01")


def test_lambada_file_errors_name_the_line(tmp_path):
    path = tmp_path / "lambada.jsonl"
    path.write_text(json.dumps({"text": "a b"}) + "\n\n" + json.dumps({"txt": "c"}) + "\n")
    with pytest.raises(ValueError, match=r"lambada.jsonl:3: expected a JSON object with a 'text' field"):
        read_lambada(str(path))
    path.write_text(json.dumps({"text": "a b"}) + "\n")
    assert read_lambada(str(path)) == ["a b"]
