"""Packed documents: the loss mask, position ids and document boundaries of a micro-batch of samples.

A GPT sample is ``seq_length + 1`` tokens cut from documents laid end to end, so one sample holds the
end of one document and the start of the next. Megatron-LM's ``--eod-mask-loss``,
``--reset-position-ids`` and ``--reset-attention-mask`` make the model treat them apart; here they
follow megatron-core's ``_get_ltor_masks_and_position_ids`` exactly, computed per sample from the
*input* tokens (``tokens = text[:-1]``, ``labels = text[1:]``):

- ``--eod-mask-loss``: no loss where the input token is EOD (the EOD itself is still predicted; the
  first token of the next document, predicted from the EOD, is not); and, as megatron-core, none where
  the label is a pad (megalite never pads a sample, so only a tokenizer with a ``pad`` id could);
- a document starts at input position 0 and right after each input EOD (the EOD ends its document);
  ``--reset-position-ids`` restarts the positions there, ``--reset-attention-mask`` stops attention there.

``--dataloader-inter-document-masking`` (Megatron-LM) takes the starts from the dataset's document
index instead of EOD tokens (``document_starts`` of the datasets), and then both resets the positions and
gives the boundaries. Everything here is numpy on the host; ``training/batches.py`` moves it to the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from megalite.config.data import DataConfig


def eod_starts(tokens: np.ndarray, eod: int) -> np.ndarray:
    """bool [b, s]: True where a document starts: position 0 and each position right after an input EOD
    (an EOD at the last position starts nothing inside the sample)."""
    starts = np.zeros(tokens.shape, dtype=bool)
    starts[:, 0] = True
    starts[:, 1:] = tokens[:, :-1] == eod
    return starts


def starts_from_positions(positions: Iterable[np.ndarray], seq_length: int) -> np.ndarray:
    """bool [b, s] from each sample's document-start positions (any in 1..s-1; position 0 is always one)."""
    rows = list(positions)
    starts = np.zeros((len(rows), seq_length), dtype=bool)
    starts[:, 0] = True
    for row, pos in zip(starts, rows):
        pos = np.asarray(pos, dtype=np.int64)
        row[pos[(pos > 0) & (pos < seq_length)]] = True
    return starts


def position_ids(starts: np.ndarray) -> np.ndarray:
    """int64 [b, s]: each token's distance from the start of its document."""
    index = np.arange(starts.shape[1], dtype=np.int64)
    last_start = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return index - last_start


def cu_seqlens(starts: np.ndarray) -> np.ndarray:
    """int32 [n + 1]: the document boundaries of the b samples flattened into one b·s token stream (the
    THD / varlen convention): 0, every sample's start (multiples of s), every document start, then b·s."""
    flat = np.flatnonzero(starts.reshape(-1))
    return np.append(flat, starts.size).astype(np.int32)


def loss_mask(tokens: np.ndarray, labels: np.ndarray, eod: int | None, pad: int | None = None) -> np.ndarray:
    """float32 [b, s]: 0 where the input token is ``eod`` (None: nowhere) or the label is ``pad``, else 1."""
    mask = np.ones(tokens.shape, dtype=np.float32)
    if eod is not None:
        mask[tokens == eod] = 0.0
    if pad is not None:
        mask[labels == pad] = 0.0
    return mask


@dataclass(frozen=True)
class DocumentMasking:
    """The packed-document flags of a run and the EOD id of its tokenizer; ``fields`` gives a micro-batch's
    loss mask, position ids and boundaries. ``pad``: a pad id whose labels get no loss (none in megalite)."""

    eod: int
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    inter_document: bool = False
    pad: int | None = None

    @classmethod
    def of(cls, cfg: DataConfig, eod: int | None) -> DocumentMasking | None:
        """The run's rule, or None when no packed-document flag is on (micro-batches as before)."""
        if not cfg.packs_documents:
            return None
        if eod is None:
            raise ValueError("the packed-document flags need the tokenizer's eod id")
        return cls(int(eod), cfg.eod_mask_loss, cfg.reset_position_ids, cfg.reset_attention_mask,
                   cfg.dataloader_inter_document_masking)

    @property
    def positions(self) -> bool:
        """Whether the micro-batch carries ``position_ids``."""
        return self.reset_position_ids or self.inter_document

    @property
    def boundaries(self) -> bool:
        """Whether the micro-batch carries ``cu_seqlens`` and ``max_seqlen``."""
        return self.reset_attention_mask or self.inter_document

    def fields(self, tokens: np.ndarray, labels: np.ndarray, document_starts: np.ndarray | None = None
               ) -> dict[str, Any]:
        """``loss_mask`` and, as the flags ask, ``position_ids``, ``cu_seqlens`` and ``max_seqlen`` (a python
        int) of inputs ``tokens`` [b, s] and their ``labels``; ``document_starts`` (bool [b, s], from the
        document index) is required with inter-document masking and replaces the EOD starts."""
        out: dict[str, Any] = {"loss_mask": loss_mask(tokens, labels, self.eod if self.eod_mask_loss else None,
                                                      self.pad)}
        if not (self.positions or self.boundaries):
            return out
        if self.inter_document:
            if document_starts is None:
                raise ValueError("--dataloader-inter-document-masking needs the samples' document starts")
            starts = document_starts
        else:
            starts = eod_starts(tokens, self.eod)
        if self.positions:
            out["position_ids"] = position_ids(starts)
        if self.boundaries:
            out["cu_seqlens"] = cu_seqlens(starts)
            out["max_seqlen"] = int(np.diff(out["cu_seqlens"]).max())
        return out


def _leaves(dataset: Any) -> Iterator[Any]:
    """The datasets a (blended) dataset draws its samples from."""
    inner = getattr(dataset, "datasets", None)
    if inner is None:
        yield dataset
        return
    for d in inner:
        yield from _leaves(d)


def prefixes_without_token(datasets: Iterable[Any], token: int) -> list[str]:
    """The data prefixes behind ``datasets`` (None entries skipped) in which a bounded look finds no
    ``token`` (IndexedDataset.has_token); synthetic datasets have no prefix and are not checked."""
    indexed: dict[str, Any] = {}
    for d in datasets:
        if d is None:
            continue
        for leaf in _leaves(d):
            ix = getattr(leaf, "indexed", None)
            if ix is not None:
                indexed.setdefault(ix.path_prefix, ix)
    return [prefix for prefix, ix in indexed.items() if not ix.has_token(token)]
