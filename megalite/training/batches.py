"""Datasets and tokenizer for a run, and turning sample indices into micro-batch tensors."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megalite.attention import Documents
from megalite.config.arguments import MegaliteConfig
from megalite.context_parallel import zigzag_index
from megalite.data.documents import DocumentMasking, prefixes_without_token, starts_from_positions
from megalite.data.sampler import microbatch_indices
from megalite.parallel.groups import ProcessGroups


@dataclass
class RunData:
    tokenizer: Any
    train: Any
    valid: Any
    test: Any


def build_run_data(cfg: MegaliteConfig, pg: ProcessGroups) -> RunData:
    """Tokenizer and train/valid/test datasets sized for this run (indices built once, on rank 0)."""
    from megalite.data import build_datasets, build_tokenizer

    t = cfg.training
    gbs = t.global_batch_size
    tokenizer = build_tokenizer(cfg.data)
    evals = t.train_iters // t.eval_interval + 1 if t.eval_iters > 0 else 0
    num_samples = (t.train_iters * gbs, evals * t.eval_iters * gbs, t.eval_iters * gbs)
    train, valid, test = build_datasets(cfg.data, seq_length=cfg.model.seq_length, seed=t.seed,
                                        num_samples=num_samples, tokenizer=tokenizer, is_builder=pg.rank == 0,
                                        barrier=pg.barrier)
    data = RunData(tokenizer, train, valid, test)
    if pg.rank == 0:
        for warning in document_warnings(cfg, data):
            print(f"megalite: warning: {warning}", file=sys.stderr, flush=True)
    return data


def document_warnings(cfg: MegaliteConfig, data: RunData) -> list[str]:
    """What the start-up says about the packed-document flags: the EOD flags on a corpus where a bounded
    look (IndexedDataset.has_token) finds no EOD, where they do nothing (one line for all such prefixes)."""
    d = cfg.data
    eod_flags = [flag for flag, on in (("--eod-mask-loss", d.eod_mask_loss),
                                       ("--reset-position-ids", d.reset_position_ids),
                                       ("--reset-attention-mask", d.reset_attention_mask)) if on]
    if d.dataloader_inter_document_masking:  # the resets then come from the document index
        eod_flags = [f for f in eod_flags if f == "--eod-mask-loss"]
    if not eod_flags:
        return []
    eod = data.tokenizer.eod
    missing = prefixes_without_token((data.train, data.valid, data.test), eod)
    if not missing:
        return []
    return [f"{', '.join(eod_flags)}: no EOD token (id {eod}) found in {', '.join(missing)} (the last token of up "
            "to 1024 of its sequences and its first 65536 tokens were read), so these flags do nothing there; "
            "preprocess with --append-eod"]


def make_microbatch(dataset: Any, indices: list[int], device: torch.device,
                    masking: DocumentMasking | None = None) -> dict[str, Any]:
    """One micro-batch of the samples ``indices`` (``seq_length + 1`` tokens each), on ``device``. The contract
    the model, the loss and context parallelism rely on (docs/data.md, "Micro-batches"):

    - ``tokens``, ``labels``: int64 [b, s], ``labels`` the tokens shifted by one (text[:-1], text[1:]);
    - ``loss_mask``: float32 [b, s], 1 where the label counts; all ones unless ``--eod-mask-loss`` (0 where the
      *input* token is EOD) or a pad label (megalite never pads);
    - only with ``--reset-position-ids``: ``position_ids`` int64 [b, s], each sample's positions restarting
      at 0 after each input EOD (input index i is EOD -> position i + 1 is 0);
    - only with ``--reset-attention-mask``: ``cu_seqlens`` int32 [n + 1], the document boundaries of the
      micro-batch flattened into one b·s token stream (THD / varlen convention): 0, every multiple of s, b·s,
      and b·s_index + i + 1 for each input EOD at index i < s - 1; strictly increasing; and ``max_seqlen``,
      a python int: the longest document (the largest difference of ``cu_seqlens``);
    - ``--dataloader-inter-document-masking`` gives both ``position_ids`` and ``cu_seqlens``/``max_seqlen``,
      the documents taken from the dataset's document index instead of EOD tokens.

    ``masking`` None (no packed-document flag): tokens, labels and an all-ones loss mask, as always."""
    text = np.stack([np.asarray(dataset[i]["text"], dtype=np.int64) for i in indices])
    on_device = torch.from_numpy(text).to(device, non_blocking=True)
    tokens, labels = on_device[:, :-1], on_device[:, 1:]
    if masking is None:
        return {"tokens": tokens, "labels": labels, "loss_mask": torch.ones_like(labels, dtype=torch.float32)}
    starts = None
    if masking.inter_document:
        starts = starts_from_positions((dataset.document_starts(i) for i in indices), text.shape[1] - 1)
    fields = masking.fields(text[:, :-1], text[:, 1:], starts)
    out: dict[str, Any] = {"tokens": tokens, "labels": labels}
    for key, value in fields.items():
        out[key] = torch.from_numpy(value).to(device, non_blocking=True) if isinstance(value, np.ndarray) else value
    return out


def global_batch(dataset: Any, consumed: int, cfg: MegaliteConfig, pg: ProcessGroups, device: torch.device,
                 eod: int | None = None) -> list[dict[str, Any]]:
    """This DP rank's micro-batches of the global batch that starts at ``consumed`` samples; ``eod``: the
    tokenizer's EOD id, which the packed-document flags need."""
    t = cfg.training
    idx = microbatch_indices(consumed, t.global_batch_size, t.micro_batch_size, pg.dp_rank, pg.dp_size)
    n = len(dataset)
    if idx and idx[-1][-1] >= n:
        raise RuntimeError(f"dataset has {n} samples but sample {idx[-1][-1]} was requested; "
                           "it was sized for fewer iterations than asked")
    masking = DocumentMasking.of(cfg.data, eod)
    mbs = [with_documents(make_microbatch(dataset, i, device, masking)) for i in idx]
    if pg.cp_size > 1:
        mbs = [context_parallel_part(mb, pg.cp_size, pg.cp_rank) for mb in mbs]
    return mbs


def with_documents(mb: dict) -> dict:
    """The micro-batch with its packed ``documents`` (from ``cu_seqlens``, --reset-attention-mask), which
    every pipeline stage and CP rank reads the same way."""
    if "cu_seqlens" in mb:
        mb["documents"] = Documents.from_cu_seqlens(mb["cu_seqlens"], *mb["tokens"].shape)
    return mb


def context_parallel_part(mb: dict, cp: int, cp_rank: int) -> dict:
    """This CP rank's tokens of a micro-batch (sequence chunks cp_rank and 2cp-1-cp_rank, see
    megalite/context_parallel), their ``sequence_index`` (global positions, which causality follows), the
    same part of ``position_ids`` when positions reset per document, the whole sequences' ``documents``, and
    ``num_tokens``: the loss-mask count of the whole sequences, which the loss is normalised by."""
    idx = zigzag_index(mb["tokens"].shape[1], cp, cp_rank).to(mb["tokens"].device)
    part = {k: mb[k].index_select(1, idx) for k in ("tokens", "labels", "loss_mask", "position_ids") if k in mb}
    part.update({k: mb[k] for k in ("cu_seqlens", "documents") if k in mb})
    part["sequence_index"] = idx
    part["num_tokens"] = mb["loss_mask"].sum()
    return part
