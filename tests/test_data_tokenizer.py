"""Promises: each --tokenizer-type gives vocab_size, eod, tokenize and detokenize that agree with the
reference implementation (Hugging Face's GPT-2 tokenizer, megatron-core's NullTokenizer), all from
local files; a missing flag or file is named in the error."""

from __future__ import annotations

import os
import re

import pytest

from megalite.data import DataConfig, build_tokenizer
from megalite.data.tokenizer_training import train_sentencepiece
from tests.data_fixtures import EXTRA_TEXTS, corpus_texts, import_mcore, scratch_dir, tiny_bpe

SAMPLES = list(corpus_texts()[:8]) + EXTRA_TEXTS + ["x = [i ** 2 for i in range(10)]  # squares\n"]


def test_null_tokenizer_matches_megatron_core():
    import_mcore()
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer as Ref

    ours, ref = build_tokenizer(DataConfig(tokenizer_type="NullTokenizer", vocab_size=1000)), Ref(1000)
    assert (ours.vocab_size, ours.eod) == (ref.vocab_size, ref._eod_id) == (1001, 1000)
    assert ours.tokenize("5 17 999") == ref.text_to_ids("5 17 999") == [5, 17, 999]
    assert ours.detokenize([5, 17]) == "5 17"


def test_gpt2_bpe_matches_hugging_face_gpt2_tokenizer():
    from transformers import GPT2TokenizerFast

    t = tiny_bpe()
    ours = build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=t["vocab_file"],
                                      merge_file=t["merge_file"]))
    ref = GPT2TokenizerFast(vocab=t["vocab_file"], merges=t["merge_file"])
    assert ours.vocab_size == len(ref) == 600 and ours.eod == ref.eos_token_id
    for text in SAMPLES:
        ids = ours.tokenize(text)
        assert ids == ref.encode(text)
        assert ours.detokenize(ids) == text
    assert ours.tokenize_batch(SAMPLES) == [ours.tokenize(s) for s in SAMPLES]
    assert ours.tokenize("a<|endoftext|>b").count(ours.eod) == 1


@pytest.mark.parametrize("source", ["tokenizer.json", "folder"])
def test_hugging_face_tokenizer_from_file_or_folder(source):
    t = tiny_bpe()
    path = t["tokenizer_json"] if source == "tokenizer.json" else t["dir"]
    hf = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=path))
    bpe = build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=t["vocab_file"],
                                     merge_file=t["merge_file"]))
    assert (hf.vocab_size, hf.eod) == (bpe.vocab_size, bpe.eod)
    for text in SAMPLES:
        assert hf.tokenize(text) == bpe.tokenize(text)
        assert hf.detokenize(hf.tokenize(text)) == text
    assert hf.tokenize_batch(SAMPLES[:3]) == [bpe.tokenize(s) for s in SAMPLES[:3]]


def test_sentencepiece_trained_locally():
    import sentencepiece as spm

    d = scratch_dir("spm")
    model = train_sentencepiece(corpus_texts(), 400, os.path.join(d, "sp"))
    tok = build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=model))
    ref = spm.SentencePieceProcessor(model_file=model)
    assert tok.vocab_size == ref.get_piece_size() and tok.eod == ref.eos_id() == 2
    text = "def tokenize(self, text):\n    return text.split()"
    assert tok.tokenize(text) == ref.encode(text)
    assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.tokenize_batch([text, "abc"]) == [ref.encode(text), ref.encode("abc")]


@pytest.mark.parametrize("fields,error,message", [
    (dict(tokenizer_type="NullTokenizer"), ValueError,
     "--vocab-size is required for --tokenizer-type NullTokenizer"),
    (dict(tokenizer_type="GPT2BPETokenizer"), ValueError,
     "--vocab-file is required for --tokenizer-type GPT2BPETokenizer"),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="VOCAB"), ValueError,
     "--merge-file is required for --tokenizer-type GPT2BPETokenizer"),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="/no/such/vocab.json", merge_file="m"),
     FileNotFoundError, "--vocab-file /no/such/vocab.json: no such file"),
    (dict(tokenizer_type="HuggingFaceTokenizer"), ValueError,
     "--tokenizer-model is required for --tokenizer-type HuggingFaceTokenizer"),
    (dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model="/no/sp.model"), FileNotFoundError,
     "--tokenizer-model /no/sp.model: no such file"),
    (dict(tokenizer_type="Tiktoken"), ValueError, "--tokenizer-type 'Tiktoken' is not one of"),
])
def test_missing_flags_and_files_are_named(fields, error, message):
    if fields.get("vocab_file") == "VOCAB":
        fields = dict(fields, vocab_file=tiny_bpe()["vocab_file"])
    with pytest.raises(error, match=re.escape(message)):
        build_tokenizer(DataConfig(**fields))
