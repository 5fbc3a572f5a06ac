"""Causal self-attention of whole sequences, optionally inside packed documents.

``core_attention`` is the model's attention core on one rank (no context parallelism) and the core the
all-to-all context-parallel path runs on its full sequences. Without documents it is one kernel call;
with ``Documents`` each document runs as its own causal sequence (one kernel call per document), so the
work is Σ len_i² and no mask exists. That holds for every --attention-backend: SDPA's kernels per document
(on CUDA the flash or memory-efficient kernel --attention-backend names), or the explicit softmax per
document for 'unfused'/'local'. On CUDA in fp16/bf16 the variable-length flash kernel takes all documents
in one call (``varlen.py``); the per-document calls are its fallback and the path every other device runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite import compat, device
from megalite.attention import varlen
from megalite.attention.documents import Documents

# --attention-backend choices that run the explicit softmax(QK^T)V reference instead of SDPA.
UNFUSED_BACKENDS = ("unfused", "local")
# CUDA's variable-length flash kernel for packed documents where it exists (tests switch it off for the fallback).
VARLEN = True


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, backend: str) -> torch.Tensor:
    """Causal attention, q [b, nq, s, d]; k, v [b, nkv, t, d], t >= s: the s queries are the last s of the
    t positions (query i sees keys 0..t-s+i); t == s is plain causal self-attention."""
    past = k.shape[2] - q.shape[2]
    if backend not in UNFUSED_BACKENDS:
        if q.shape[1] != k.shape[1] and backend == "fused":  # SDPA's memory-efficient kernel has no GQA
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if past == 0:  # training and prefill: the kernel --attention-backend names (device.py decides)
            with device.sdpa_kernels(backend, q.device):
                return compat.sdpa(q, k, v, dropout_p=dropout_p, is_causal=True)
        # decoding with a KV cache needs an explicit mask, which the flash kernel lacks: SDPA's own choice
        allowed = None if q.shape[2] == 1 else torch.ones(
            q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(past)
        return compat.sdpa(q, k, v, attn_mask=allowed, dropout_p=dropout_p)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(1 + past)
    probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
    return F.dropout(probs, dropout_p) @ v


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, backend: str,
                   documents: Documents | None = None) -> torch.Tensor:
    """Causal attention (``_causal``); with ``documents`` (q, k, v of the same s positions) attention stops at
    the document boundaries: each document is attended as its own sequence and the outputs concatenated."""
    if documents is None or documents.uniform:
        return _causal(q, k, v, dropout_p, backend)
    if k.shape[2] != q.shape[2] or documents.seq_length != q.shape[2] or documents.batch != q.shape[0]:
        raise ValueError(f"document attention needs q, k, v of the documents' {documents.batch} x "
                         f"{documents.seq_length} positions, got q {list(q.shape)}, k {list(k.shape)}")
    if VARLEN and varlen.usable(q, dropout_p, backend):
        return varlen.varlen_attention(q, k, v, documents)
    # unbind and split (whose backwards are one stack and one concatenation), not slices (each of whose
    # backwards would fill a zero gradient of the whole tensor)
    rows = []
    for b, (qb, kb, vb) in enumerate(zip(q.unbind(0), k.unbind(0), v.unbind(0))):
        lengths = documents.lengths(b)
        parts = [_causal(qd[None], kd[None], vd[None], dropout_p, backend)
                 for qd, kd, vd in zip(*(t.split(lengths, dim=1) for t in (qb, kb, vb)))]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)
