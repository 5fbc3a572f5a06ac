"""Train tokenizers from local text, so nothing needs a download.

Byte-level BPE (GPT-2 style) writes ``vocab.json`` + ``merges.txt`` (for ``GPT2BPETokenizer``) and
``tokenizer.json`` + ``tokenizer_config.json`` (so the folder also works as a
``HuggingFaceTokenizer``). SentencePiece writes ``{prefix}.model``. Training is deterministic.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Iterator

from megalite.config.strict_load import StrictReadError, load_json_line

EOD_TOKEN = "<|endoftext|>"


def iter_texts(paths: list[str], json_keys: list[str]) -> Iterator[str]:
    """Texts of jsonl(.gz) files (the given keys) or, for other files, whole files."""
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        if path.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
            with opener(path, "rt", encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = load_json_line(line, f"{path}:{n}")
                    except StrictReadError:  # a key twice (json.loads would keep the last), or too deep
                        raise
                    except ValueError as e:
                        raise ValueError(f"{path}:{n}: malformed JSON ({e})") from e
                    for k in json_keys:
                        v = obj.get(k) if isinstance(obj, dict) else None
                        if isinstance(v, str):
                            yield v
                        elif isinstance(v, list):
                            yield from (s for s in v if isinstance(s, str))
        else:
            with opener(path, "rt", encoding="utf-8", errors="replace") as f:
                yield f.read()


def train_bpe(texts: Iterable[str], vocab_size: int, output_dir: str,
              min_frequency: int = 2) -> dict[str, str]:
    """Train a GPT-2 style byte-level BPE; returns the paths written."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise ValueError(f"a byte-level BPE needs --vocab-size above 257 (256 bytes + eod), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=[EOD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken(EOD_TOKEN, special=True, normalized=False)])
    os.makedirs(output_dir, exist_ok=True)
    tok.model.save(output_dir)  # vocab.json, merges.txt
    paths = {"vocab_file": os.path.join(output_dir, "vocab.json"),
             "merge_file": os.path.join(output_dir, "merges.txt"),
             "tokenizer_json": os.path.join(output_dir, "tokenizer.json")}
    tok.save(paths["tokenizer_json"])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD_TOKEN, "bos_token": EOD_TOKEN,
              "unk_token": EOD_TOKEN, "model_max_length": 1 << 30}
    with open(os.path.join(output_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return paths


def train_sentencepiece(texts: Iterable[str], vocab_size: int, output_prefix: str,
                        model_type: str = "bpe") -> str:
    """Train a SentencePiece model; returns ``{output_prefix}.model``. Text is kept as is (no
    normalisation, whitespace preserved, unknown characters as bytes) so code round-trips exactly."""
    import sentencepiece as spm

    lines = (line for text in texts for line in text.splitlines() if line.strip())
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines, model_prefix=output_prefix, vocab_size=vocab_size, model_type=model_type,
        byte_fallback=True, character_coverage=1.0, num_threads=1, minloglevel=2,
        normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, hard_vocab_limit=False)
    return output_prefix + ".model"
