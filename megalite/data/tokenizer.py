"""Tokenizers behind one small interface, chosen by ``--tokenizer-type`` (Megatron-LM names).

Every tokenizer has ``vocab_size`` (unpadded), ``eod`` (the id appended after each document),
``tokenize(str) -> list[int]``, ``detokenize(list[int]) -> str`` and ``tokenize_batch`` (the fast path
preprocessing uses). Nothing here downloads: every tokenizer is read from local files.
"""

from __future__ import annotations

import json
import os
from typing import Protocol

from megalite.data.errors import MissingFileError

TOKENIZER_TYPES = ("NullTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer")
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")


class Tokenizer(Protocol):
    vocab_size: int
    eod: int

    def tokenize(self, text: str) -> list[int]: ...
    def tokenize_batch(self, texts: list[str]) -> list[list[int]]: ...
    def detokenize(self, ids: list[int]) -> str: ...


class NullTokenizer:
    """Text is whitespace-separated token ids. Like Megatron-core's, ``--vocab-size V`` gives ids
    ``0..V-1`` for data and ``eod = V``, so ``vocab_size`` is ``V + 1``."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = int(vocab_size) + 1
        self.eod = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class _HFTokenizersBase:
    """Shared encode/decode over a ``tokenizers.Tokenizer`` (Rust, fast batch encoding)."""

    _tok = None

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def detokenize(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class GPT2BPETokenizer(_HFTokenizersBase):
    """GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``; ``eod`` is ``<|endoftext|>``, which
    is also recognised as one token inside text (as GPT-2's Hugging Face tokenizer does)."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
        if "<|endoftext|>" not in vocab:
            raise ValueError(f"--vocab-file {vocab_file} has no '<|endoftext|>' token to end documents with")
        tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eod = vocab["<|endoftext|>"]


class HuggingFaceTokenizer(_HFTokenizersBase):
    """A local ``tokenizer.json`` (read with ``tokenizers``) or a tokenizer folder (read with
    ``transformers.AutoTokenizer``, offline). ``eod`` is the eos token, else a usual end-of-text token."""

    def __init__(self, path: str) -> None:
        self._hf = None
        if os.path.isdir(path):
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
            vocab = self._hf.get_vocab()
            self.vocab_size = len(self._hf)
            eod = self._hf.eos_token_id
            if getattr(self._hf, "is_fast", False):
                self._tok = self._hf.backend_tokenizer
        else:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(path)
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
            eod = None
        if eod is None:
            eod = next((vocab[t] for t in EOD_CANDIDATES if t in vocab), None)
        if eod is None:
            raise ValueError(f"--tokenizer-model {path}: no eos token and none of {EOD_CANDIDATES} in the "
                             f"vocabulary, so documents cannot be ended")
        self.eod = int(eod)

    def tokenize(self, text: str) -> list[int]:
        if self._tok is None:
            return self._hf.encode(text, add_special_tokens=False)
        return super().tokenize(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if self._tok is None:
            return [self._hf.encode(t, add_special_tokens=False) for t in texts]
        return super().tokenize_batch(texts)

    def detokenize(self, ids: list[int]) -> str:
        if self._hf is not None:
            return self._hf.decode([int(i) for i in ids])
        return super().detokenize(ids)


class SentencePieceTokenizer:
    """A SentencePiece ``.model``; ``eod`` is its eos id."""

    def __init__(self, model_file: str) -> None:
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor(model_file=model_file)
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise ValueError(f"--tokenizer-model {model_file} has no eos piece to end documents with")

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts, num_threads=1)

    def detokenize(self, ids: list[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def _need_file(value: str | None, flag: str, kind: str, dir_ok: bool = False) -> str:
    if not value:
        raise ValueError(f"{flag} is required for --tokenizer-type {kind}")
    ok = os.path.exists(value) if dir_ok else os.path.isfile(value)
    if not ok:
        raise MissingFileError(f"{flag} {value}: no such file")
    return value


def build_tokenizer(cfg) -> Tokenizer:
    """The tokenizer named by ``cfg.tokenizer_type`` (a DataConfig or any object with its fields)."""
    kind = cfg.tokenizer_type
    if kind == "NullTokenizer":
        if cfg.vocab_size is None:
            raise ValueError("--vocab-size is required for --tokenizer-type NullTokenizer")
        if cfg.vocab_size < 1:
            raise ValueError(f"--vocab-size must be positive, got {cfg.vocab_size}")
        return NullTokenizer(cfg.vocab_size)
    if kind == "GPT2BPETokenizer":
        vocab = _need_file(cfg.vocab_file, "--vocab-file", kind)
        merges = _need_file(cfg.merge_file, "--merge-file", kind)
        return GPT2BPETokenizer(vocab, merges)
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(_need_file(cfg.tokenizer_model, "--tokenizer-model", kind, dir_ok=True))
    if kind == "SentencePieceTokenizer":
        return SentencePieceTokenizer(_need_file(cfg.tokenizer_model, "--tokenizer-model", kind))
    raise ValueError(f"--tokenizer-type {kind!r} is not one of {', '.join(TOKENIZER_TYPES)}")
