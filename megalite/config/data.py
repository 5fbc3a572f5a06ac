"""Data and tokenizer flags (Megatron-LM names)."""

from __future__ import annotations

from dataclasses import dataclass

from megalite.config.domain import MAX_SIZE, fraction, size
from megalite.config.flags import option


@dataclass(kw_only=True)
class DataConfig:
    """Data and tokenizer: where samples come from and how text becomes tokens."""

    data_path: list[str] | None = option(
        None, help="Dataset prefixes, optionally weighted: 'a' or '0.7 a 0.3 b'. Split by --split.")
    train_data_path: list[str] | None = option(
        None, help="Training dataset prefixes (weighted), instead of --data-path.")
    valid_data_path: list[str] | None = option(
        None, help="Validation dataset prefixes (weighted), instead of --data-path.")
    test_data_path: list[str] | None = option(
        None, help="Test dataset prefixes (weighted), instead of --data-path.")
    split: str = option("969,30,1", help="Train,valid,test proportions of the documents of --data-path.")
    data_cache_path: str | None = option(
        None, help="Where the cached sample indices (.npy) go; default: a cache/ folder beside the data.")
    mid_level_dataset_surplus: float = option(
        0.005, help="Extra fraction of samples each blended dataset builds beyond its share of the blend.",
        domain=fraction())
    mock_data: bool = option(False, help="Train on synthetic, learnable token sequences (no files needed).")
    tokenizer_type: str | None = option(
        None, help="Tokenizer kind; default GPT2BPETokenizer when --vocab-file and --merge-file are given "
        "(as Megatron-LM), else NullTokenizer.",
        choices=["NullTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer"])
    vocab_size: int | None = option(
        None, help="NullTokenizer: data ids are 0..V-1 and the eod id is V (vocabulary V + 1).",
        domain=size(MAX_SIZE - 1))
    vocab_file: str | None = option(None, help="GPT-2 BPE vocab.json.")
    merge_file: str | None = option(None, help="GPT-2 BPE merges.txt.")
    tokenizer_model: str | None = option(
        None, help="tokenizer.json / tokenizer folder, or SentencePiece .model.")
    def __post_init__(self) -> None:
        if self.tokenizer_type is None:
            bpe = self.vocab_file is not None and self.merge_file is not None
            self.tokenizer_type = "GPT2BPETokenizer" if bpe else "NullTokenizer"
