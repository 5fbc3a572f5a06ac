"""Datasets and tokenizer for a run, and turning sample indices into micro-batch tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megalite.attention import Documents
from megalite.config.arguments import MegaliteConfig
from megalite.context_parallel import zigzag_index
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
    return RunData(tokenizer, train, valid, test)


def make_microbatch(dataset: Any, indices: list[int], device: torch.device) -> dict[str, torch.Tensor]:
    """tokens/labels [b, s] from samples of seq+1 tokens (labels are tokens shifted by one)."""
    text = torch.from_numpy(np.stack([np.asarray(dataset[i]["text"], dtype=np.int64) for i in indices]))
    text = text.to(device, non_blocking=True)
    tokens, labels = text[:, :-1], text[:, 1:]
    return {"tokens": tokens, "labels": labels, "loss_mask": torch.ones_like(labels, dtype=torch.float32)}


def global_batch(dataset: Any, consumed: int, cfg: MegaliteConfig, pg: ProcessGroups, device: torch.device
                 ) -> list[dict[str, torch.Tensor]]:
    """This DP rank's micro-batches of the global batch that starts at ``consumed`` samples."""
    t = cfg.training
    idx = microbatch_indices(consumed, t.global_batch_size, t.micro_batch_size, pg.dp_rank, pg.dp_size)
    n = len(dataset)
    if idx and idx[-1][-1] >= n:
        raise RuntimeError(f"dataset has {n} samples but sample {idx[-1][-1]} was requested; "
                           "it was sized for fewer iterations than asked")
    mbs = [with_documents(make_microbatch(dataset, i, device)) for i in idx]
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
