"""Data and tokenizer flags (Megatron-LM names)."""

from __future__ import annotations

from dataclasses import dataclass

from megalite.config.domain import MAX_SIZE, fraction, size
from megalite.config.flags import option

# The packed-document flags (docs/data.md, "Packed documents"); a checkpoint records them.
DOCUMENT_FLAGS = ("eod_mask_loss", "reset_position_ids", "reset_attention_mask", "dataloader_inter_document_masking")


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
    eod_mask_loss: bool = option(
        False, help="No loss where the input token is the tokenizer's EOD (so the first token of the next "
        "document is not predicted from the previous one; the EOD itself still is). docs/data.md.")
    reset_position_ids: bool = option(
        False, help="Position ids restart at 0 after each EOD in a sample (the EOD ends its document); the "
        "micro-batch carries them as position_ids [b, s].")
    reset_attention_mask: bool = option(
        False, help="Attention stops at the same document boundaries: the micro-batch carries them as "
        "cu_seqlens (no dense mask is ever built).")
    dataloader_inter_document_masking: bool = option(
        False, help="Document boundaries from the dataset's document index instead of EOD tokens (Megatron-LM): "
        "positions restart and attention stops at each document of the index (works without EODs).")

    @property
    def packs_documents(self) -> bool:
        """Whether any packed-document flag is on (the micro-batches then follow docs/data.md's rules, and
        --mock-data yields EOD-terminated documents)."""
        return any(getattr(self, name) for name in DOCUMENT_FLAGS)

    def __post_init__(self) -> None:
        if self.tokenizer_type is None:
            bpe = self.vocab_file is not None and self.merge_file is not None
            self.tokenizer_type = "GPT2BPETokenizer" if bpe else "NullTokenizer"
