"""Data pipeline: tokenizers, Megatron-format indexed datasets, GPT sample indices, blending.

The training loop needs two calls::

    tokenizer = build_tokenizer(cfg)
    train, valid, test = build_datasets(cfg, seq_length=..., seed=..., num_samples=(n_train, n_valid, n_test),
                                        tokenizer=tokenizer, is_builder=rank == 0, barrier=pg.barrier)

Each dataset maps an index to ``{"text": int64 array of seq_length + 1 tokens}``; a split with no
requested samples or no documents is None. Nothing here needs torch (samples are numpy arrays).
"""

from __future__ import annotations

from collections.abc import Callable

from megalite.config.data import DataConfig
from megalite.data.errors import DataError
from megalite.data.tokenizer import Tokenizer, build_tokenizer

__all__ = ["DataConfig", "Tokenizer", "build_datasets", "build_tokenizer"]


def build_datasets(cfg: DataConfig, *, seq_length: int, seed: int,
                   num_samples: tuple[int | None, int | None, int | None], tokenizer: Tokenizer,
                   is_builder: bool, barrier: Callable[[], None] | None) -> tuple:
    """Train, valid and test datasets (each may be None).

    With ``--mock-data``: synthetic samples (vocabulary ``tokenizer.vocab_size``); train uses ``seed``,
    valid and test ``seed + 1`` and ``seed + 2`` so that they are not copies of the training samples; with a
    packed-document flag they are documents ending in ``tokenizer.eod`` (docs/data.md).
    Otherwise Megatron's ``--data-path``/``--split``/blend semantics, and every file's largest token
    id must be below ``tokenizer.vocab_size`` (TokenRangeError names the file otherwise). The process
    with ``is_builder`` (global rank 0) computes and caches the index arrays; then every process calls ``barrier()`` (if
    given); then the others load the cache. Every process must call this.
    """
    if len(num_samples) != 3:
        raise ValueError(f"num_samples needs (train, valid, test) counts, got {num_samples}")
    if cfg.mock_data:
        from megalite.data.mock import MockGPTDataset

        eod = tokenizer.eod if cfg.packs_documents else None
        return tuple(MockGPTDataset(n, seq_length, tokenizer.vocab_size, seed + i, eod) if n else None
                     for i, n in enumerate(num_samples))
    per_split = [cfg.train_data_path, cfg.valid_data_path, cfg.test_data_path]
    if cfg.data_path and any(per_split):
        raise DataError("use either --data-path (with --split) or --train/valid/test-data-path, not both")
    if not cfg.data_path and not any(per_split):
        raise DataError("--data-path (or --train-data-path/--valid-data-path/--test-data-path) is "
                         "required unless --mock-data is given")
    from megalite.data.builder import build_gpt_datasets

    return build_gpt_datasets(cfg.data_path, cfg.split, per_split, seq_length=seq_length, seed=seed,
                              num_samples=num_samples, cache_path=cfg.data_cache_path,
                              surplus=cfg.mid_level_dataset_surplus, is_builder=is_builder,
                              barrier=barrier, vocab_size=tokenizer.vocab_size)
