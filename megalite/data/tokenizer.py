"""Tokenizers behind one small interface, chosen by ``--tokenizer-type`` (Megatron-LM names).

Every tokenizer has ``vocab_size`` (unpadded), ``eod`` (the id appended after each document),
``tokenize(str) -> list[int]``, ``detokenize(list[int]) -> str`` and ``tokenize_batch`` (the fast path
preprocessing uses). Nothing here downloads: every tokenizer is read from local files.
"""

from __future__ import annotations

import json
import os
from typing import Protocol

from megalite.config.strict_load import StrictReadError, load_json
from megalite.data.errors import DataError, MissingFileError, TokenizerError

TOKENIZER_TYPES = ("NullTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer")
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
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
        ids = []
        for word in text.split():
            try:
                ids.append(int(word))
            except ValueError:
                raise DataError(f"NullTokenizer reads whitespace-separated integer token ids, got {word[:40]!r}"
                                ) from None
        return ids

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

        vocab = _read_bpe_vocab(vocab_file)
        _check_merges(merge_file)
        try:
            tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        except Exception as e:  # the Rust reader's own complaint, e.g. a merge of tokens not in the vocab
            raise TokenizerError(f"--vocab-file {vocab_file} and --merge-file {merge_file} do not form a GPT-2 "
                                 f"BPE tokenizer: {_first_line(e)}") from None
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        if "<|endoftext|>" not in vocab:
            raise TokenizerError(f"--vocab-file {vocab_file} has no '<|endoftext|>' token to end documents with")
        tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eod = vocab["<|endoftext|>"]


class HuggingFaceTokenizer(_HFTokenizersBase):
    """A local ``tokenizer.json`` (read with ``tokenizers``) or a tokenizer folder (read with
    ``transformers.AutoTokenizer``, offline). ``eod`` is the eos token, else a usual end-of-text token."""

    def __init__(self, path: str) -> None:
        self._hf = None
        _check_hf_json(path)
        if os.path.isdir(path):
            from transformers import AutoTokenizer

            if not any(os.path.isfile(os.path.join(path, f)) for f in HF_TOKENIZER_FILES):
                raise TokenizerError(f"--tokenizer-model {path} is a folder without a Hugging Face tokenizer (none of "
                                     f"{', '.join(HF_TOKENIZER_FILES)} in it)")
            try:
                self._hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
            except Exception as e:  # transformers raises OSError, ValueError or its own errors
                raise TokenizerError(f"--tokenizer-model {path} is not a Hugging Face tokenizer folder "
                                     f"(tokenizer.json / tokenizer_config.json): {_first_line(e)}") from None
            vocab = self._hf.get_vocab()
            self.vocab_size = len(self._hf)
            eod = self._hf.eos_token_id
            if getattr(self._hf, "is_fast", False):
                self._tok = self._hf.backend_tokenizer
        else:
            from tokenizers import Tokenizer

            try:
                self._tok = Tokenizer.from_file(path)
            except Exception as e:  # the Rust reader raises a bare Exception
                hint = (" (it is not JSON text: a SentencePiece .model is read with --tokenizer-type "
                        "SentencePieceTokenizer)" if not _is_utf8(path) else "")
                raise TokenizerError(f"--tokenizer-model {path} is not a Hugging Face tokenizer.json: "
                                     f"{_first_line(e)}{hint}") from None
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
            eod = None
        if eod is None:
            eod = next((vocab[t] for t in EOD_CANDIDATES if t in vocab), None)
        if eod is None:
            raise TokenizerError(f"--tokenizer-model {path}: no eos token and none of {EOD_CANDIDATES} in the "
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

        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_file)
        except (RuntimeError, OSError) as e:
            hint = (" (it is text: a Hugging Face tokenizer.json is read with --tokenizer-type HuggingFaceTokenizer, "
                    "a vocab.json with GPT2BPETokenizer)" if _is_utf8(model_file) else "")
            raise TokenizerError(f"--tokenizer-model {model_file} is not a SentencePiece model: "
                                 f"{_first_line(e)}{hint}") from None
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise TokenizerError(f"--tokenizer-model {model_file} has no eos piece to end documents with")

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts, num_threads=1)

    def detokenize(self, ids: list[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _is_utf8(path: str, limit: int = 1 << 16) -> bool:
    with open(path, "rb") as f:
        head = f.read(limit)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start > limit - 4  # a character cut at the end of the sample is fine
    return True


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{flag} {path} is not UTF-8 text (byte {e.start}): is it the right file?") from None


HF_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "added_tokens.json",
                 "special_tokens_map.json")


def _check_hf_json(path: str) -> None:
    """Read a tokenizer.json (or a folder's JSON files) with the strict reader first: the Rust and
    transformers readers keep the last of two equal vocabulary keys without a word, which changes token ids.
    Text that is not JSON is left to the tokenizer's own reader, whose message names the kind of file."""
    files = [os.path.join(path, f) for f in HF_JSON_FILES] if os.path.isdir(path) else [path]
    for file in files:
        if not os.path.isfile(file):
            continue
        try:
            with open(file, encoding="utf-8") as f:
                load_json(f.read(), f"--tokenizer-model {file}")
        except StrictReadError as e:
            raise TokenizerError(str(e)) from None
        except (ValueError, OSError):  # not JSON text: the tokenizer's reader says what it is
            pass


def _looks_like_merges(text: str) -> bool:
    first = next((line for line in text.splitlines() if line.strip()), "")
    return first.startswith("#version") or len(first.split(" ")) == 2


def _read_bpe_vocab(path: str) -> dict:
    """vocab.json as a dict; a merges file (or anything else) given as --vocab-file is named."""
    text = _read_text(path, "--vocab-file")
    try:
        vocab = load_json(text, f"--vocab-file {path}")
    except StrictReadError as e:
        raise TokenizerError(str(e)) from None
    except json.JSONDecodeError as e:
        hint = (": it looks like a merges file (did you swap --vocab-file and --merge-file?)"
                if _looks_like_merges(text) else "")
        raise TokenizerError(f"--vocab-file {path} is not a GPT-2 vocab.json (a JSON object of token -> id): "
                             f"line {e.lineno}: {e.msg}{hint}") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise TokenizerError(f"--vocab-file {path} is not a GPT-2 vocab.json: expected a JSON object of token -> "
                             f"integer id, got {type(vocab).__name__}")
    return vocab


def _check_merges(path: str) -> None:
    """Every line of merges.txt (after an optional '#version' header) is two tokens and a space."""
    text = _read_text(path, "--merge-file")
    if text.lstrip().startswith(("{", "[")):
        raise TokenizerError(f"--merge-file {path} is JSON, not a merges.txt (lines of two tokens): did you swap "
                             f"--vocab-file and --merge-file?")
    for n, line in enumerate(text.splitlines(), 1):
        if (n == 1 and line.startswith("#version")) or not line.strip():
            continue
        if len(line.split(" ")) != 2:
            raise TokenizerError(f"--merge-file {path}, line {n}: expected two tokens separated by one space, "
                                 f"got {line[:60]!r}")


def _need_file(value: str | None, flag: str, kind: str, dir_ok: bool = False) -> str:
    if not value:
        raise DataError(f"{flag} is required for --tokenizer-type {kind}")
    if os.path.isdir(value) and not dir_ok:
        raise MissingFileError(f"{flag} {value} is a directory; --tokenizer-type {kind} reads a file")
    ok = os.path.exists(value) if dir_ok else os.path.isfile(value)
    if not ok:
        raise MissingFileError(f"{flag} {value}: no such file")
    return value


def build_tokenizer(cfg) -> Tokenizer:
    """The tokenizer named by ``cfg.tokenizer_type`` (a DataConfig or any object with its fields)."""
    kind = cfg.tokenizer_type
    if kind == "NullTokenizer":
        if cfg.vocab_size is None:
            raise DataError("--vocab-size is required for --tokenizer-type NullTokenizer")
        if cfg.vocab_size < 1:
            raise DataError(f"--vocab-size must be positive, got {cfg.vocab_size}")
        return NullTokenizer(cfg.vocab_size)
    if kind == "GPT2BPETokenizer":
        vocab = _need_file(cfg.vocab_file, "--vocab-file", kind)
        merges = _need_file(cfg.merge_file, "--merge-file", kind)
        return GPT2BPETokenizer(vocab, merges)
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(_need_file(cfg.tokenizer_model, "--tokenizer-model", kind, dir_ok=True))
    if kind == "SentencePieceTokenizer":
        return SentencePieceTokenizer(_need_file(cfg.tokenizer_model, "--tokenizer-model", kind))
    raise DataError(f"--tokenizer-type {kind!r} is not one of {', '.join(TOKENIZER_TYPES)}")
