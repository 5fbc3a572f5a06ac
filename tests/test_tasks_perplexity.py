"""Promises of the WIKITEXT103 perplexity task (megalite/inference/evaluation.py, Megatron's semantics):
- the sliding windows score every target token exactly once, whatever --seq-length / --overlapping-eval;
- on models whose answer is known the perplexity is that answer: all-zero weights give the uniform
  distribution (token ppl = vocab size), a constant "unigram" model gives exp(mean -log p(target));
- word-level ("adjusted") ppl uses Megatron's word count of the original text and the token ratio;
- the numbers do not depend on the micro-batch size; bad flags are refused by name."""

from __future__ import annotations

import math

import pytest
import torch

from megalite.config.model import ModelConfig
from megalite.inference.evaluation import (
    PerplexityResult,
    count_words,
    detokenizer_for,
    evaluate_perplexity,
    lm_windows,
    wikitext_detokenize,
)
from megalite.parallel.groups import ProcessGroups
from tests.test_generation import one_thread  # noqa: F401 - autouse fixture
from tests.tp_utils import GPT2, build

VOCAB = 50  # padded to 128 inside the model; the padding must not take probability mass


@pytest.mark.parametrize("targets,seq,ov", [(100, 16, 16), (100, 16, 4), (100, 16, 1), (10, 16, 4), (16, 16, 16),
                                            (17, 16, 5), (1, 8, 8), (33, 8, 3)])
def test_windows_score_every_target_exactly_once(targets, seq, ov):
    tokens = list(range(targets + 1))
    scored = []
    for w in lm_windows(tokens, seq, ov):
        assert 2 <= len(w.tokens) <= seq + 1 or len(w.tokens) == 1
        assert w.tokens == tokens[w.tokens[0]: w.tokens[0] + len(w.tokens)]  # contiguous text
        scored += [w.tokens[j + 1] for j in w.scored]  # the token each scored position predicts
    assert sorted(scored) == list(range(1, targets + 1)), "each target once"


def test_overlapping_windows_give_later_targets_longer_context():
    windows = lm_windows(list(range(41)), 16, 4)
    assert [w.tokens[0] for w in windows[:3]] == [0, 4, 8]
    assert list(windows[1].scored) == list(range(12, 16))  # its last 4 targets, each with 12+ tokens before it
    assert len(lm_windows(list(range(41)), 16, None)) == 3  # None: non-overlapping windows


def test_overlap_larger_than_window_is_refused():
    with pytest.raises(ValueError, match=r"--overlapping-eval \(20\) must be <= --seq-length \(16\)"):
        lm_windows(list(range(100)), 16, 20)


def _zero_model(untied: bool = False):
    cfg = ModelConfig(**{**GPT2, "seq_length": 16, "untie_embeddings_and_output_weights": untied})
    model = build(cfg, ProcessGroups.single(), VOCAB)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model.eval()


def test_all_zero_weights_give_perplexity_equal_to_the_vocab_size():
    tokens = torch.randint(0, VOCAB, (203,), generator=torch.Generator().manual_seed(0)).tolist()
    res = evaluate_perplexity([_zero_model()], ProcessGroups.single(), tokens, num_original_tokens=101,
                              seq_length=16, overlapping_eval=4, micro_batch_size=3, pad=0)
    assert res.num_targets == 202
    assert res.ppl == pytest.approx(VOCAB, rel=1e-6)  # uniform over the true vocab, never the padding
    assert res.token_ratio == pytest.approx(202 / 100)
    assert res.adjusted_ppl == pytest.approx(VOCAB ** (202 / 100), rel=1e-5)


def test_constant_unigram_model_perplexity_is_the_closed_form():
    """Zero weights except the final LayerNorm bias b and an untied output layer W: every position's
    logits are W b, whatever the input, so ppl = exp(mean over targets of -log softmax(W b)[target])."""
    model = _zero_model(untied=True)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.final_norm.bias.copy_(torch.randn(model.final_norm.bias.shape, generator=gen))
        model.output_layer.weight[:VOCAB].copy_(0.2 * torch.randn(VOCAB, model.cfg.hidden_size, generator=gen))
    logp = torch.log_softmax(model.output_layer.weight[:VOCAB].double() @ model.final_norm.bias.double(), dim=0)
    tokens = torch.randint(0, VOCAB, (150,), generator=gen).tolist()
    want = math.exp(-sum(logp[t].item() for t in tokens[1:]) / 149)  # every token but the first is a target
    for mbs, ov in ((1, 16), (4, 5), (7, 1)):
        res = evaluate_perplexity([model], ProcessGroups.single(), tokens, 75, 16, ov, mbs, pad=0)
        assert res.ppl == pytest.approx(want, rel=1e-5), (mbs, ov)
        assert res.adjusted_ppl == pytest.approx(want ** (149 / 74), rel=1e-4)
    assert 1.0 < want < VOCAB / 2 or want > 2 * VOCAB, f"ppl {want}: the unigram must be far from uniform"


def test_megatron_result_line_and_cap():
    res = PerplexityResult(total_loss=2.0 * 99, num_tokenized_tokens=100, num_original_tokens=51, num_windows=7)
    assert res.line("WIKITEXT103") == (" validation results on WIKITEXT103 | avg loss: 2.0000E+00 | ppl: 7.3891E+00 | "
                                       "adjusted ppl: 5.2457E+01 | token ratio: 1.98 |")
    assert PerplexityResult(50.0 * 9, 10, 10, 1).ppl == pytest.approx(math.exp(20))  # Megatron caps at e^20


def test_word_count_and_wikitext_detokenizer():
    raw = " = Valkyria Chronicles III = \n Senjō no Valkyria 3 : Unrecorded Chronicles ( Japanese ) , 1 @,@ 000 " \
          "km @-@ long , it 's the \" best \" . \n"
    assert count_words(raw) == len(raw.strip().split(" "))
    assert wikitext_detokenize(raw) == (" = Valkyria Chronicles III =\nSenjō no Valkyria 3: Unrecorded Chronicles "
                                        "(Japanese), 1,000 km-long, it's the \"best\".\n")
    assert detokenizer_for("data/wiki.test.tokens") is wikitext_detokenize
    assert detokenizer_for("data/other.txt")("a , b") == "a , b"
