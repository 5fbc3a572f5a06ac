"""Causal self-attention of whole sequences, optionally inside packed documents.

``core_attention`` is the model's attention core on one rank (no context parallelism) and the core the
all-to-all context-parallel path runs on its full sequences. Without documents it is one kernel call;
with ``Documents`` each document runs as its own causal sequence (one kernel call per document), so the
work is Σ len_i² and no mask exists. That holds for every --attention-backend: SDPA's kernels per document
(on CUDA the flash or memory-efficient kernel --attention-backend names), or the explicit softmax per
document for 'unfused'/'local'. On CUDA in fp16/bf16 the variable-length flash kernel takes all documents
in one call (``varlen.py``); the per-document calls are its fallback and the path every other device runs.

Soft-capping (--attn-logit-softcapping C: scores C·tanh(s/C) before masks and softmax) is never dropped: the
'unfused'/'local' reference caps its explicit scores; SDPA and the flash kernels cannot cap, so with a cap the
other backends run the blockwise path (``_Blockwise``, which caps each score tile) in training and prefill,
and the explicit softmax when decoding from a KV cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite import compat, device
from megalite.attention import varlen
from megalite.attention.blocks import _expand, _fold, attend, attend_backward
from megalite.attention.documents import Documents

# --attention-backend choices that run the explicit softmax(QK^T)V reference instead of SDPA.
UNFUSED_BACKENDS = ("unfused", "local")
# CUDA's variable-length flash kernel for packed documents where it exists (tests switch it off for the fallback).
VARLEN = True


def _window_allowed(sq: int, sk: int, window: int, device: torch.device) -> torch.Tensor:
    """[sq, sk] bool: query i (the last sq of sk positions) sees key j when i - window < j <= i."""
    d = torch.arange(sk - sq, sk, device=device)[:, None] - torch.arange(sk, device=device)[None, :]
    return (d >= 0) & (d < window)


def _explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor, dropout_p: float,
              softcap: float) -> torch.Tensor:
    """The reference softmax(cap(QK^T/√d))V with K/V repeated to the query heads; ``masked`` [sq, sk] bool:
    the pairs left out; ``softcap`` C > 0: scores C·tanh(s/C) before the mask (0: none)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    probs = scores.masked_fill(masked, float("-inf")).softmax(dim=-1)
    return F.dropout(probs, dropout_p) @ v


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, backend: str,
            window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention, q [b, nq, s, d]; k, v [b, nkv, t, d], t >= s: the s queries are the last s of the
    t positions (query i sees keys 0..t-s+i); t == s is plain causal self-attention. ``window`` > 0: query
    i sees only the keys i - window < j <= i (here by a mask: the reference and the decoding path).
    ``softcap``: the logit cap, which SDPA cannot apply: the explicit softmax runs on every backend then."""
    past = k.shape[2] - q.shape[2]
    explicit = backend in UNFUSED_BACKENDS or bool(softcap)
    if window and window < k.shape[2]:
        allowed = _window_allowed(q.shape[2], k.shape[2], window, q.device)
        if not explicit:
            return compat.sdpa(q, k, v, attn_mask=allowed, dropout_p=dropout_p)
        return _explicit(q, k, v, ~allowed, dropout_p, softcap)
    if not explicit:
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
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(1 + past)
    return _explicit(q, k, v, mask, dropout_p, softcap)


def _stacked(k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """K and V [b, g, s, d] repeated to the query heads once for all pieces (the fused kernels take equal
    head counts; per piece the repeat would be copied again and again), stacked: [2, b, heads, s, d]."""
    return torch.stack([_expand(k, heads), _expand(v, heads)])


class _Blockwise(torch.autograd.Function):
    """Attention over the pieces a sliding window leaves (``documents.pieces`` with a window): the blockwise
    kernels of ``blocks.py`` with the log-sum-exp merge, so the work is that of the pieces, not s². Also the
    path of a soft-capped layer on the SDPA backends (``softcap``: the blocks cap each score tile)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents, p: float,
                softcap: float = 0.0) -> torch.Tensor:
        pieces = documents.pieces(0, documents.seq_length, 0, documents.seq_length)
        ctx.pieces, ctx.p, ctx.softcap = pieces, p, softcap
        ctx.rng = device.get_rng_state() if p > 0 else None  # the backward redraws the same masks
        kv = _stacked(k, v, q.shape[1])
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
        attend(q, kv, pieces, out, lse, p, softcap)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)  # k and v themselves (autograd keeps them anyway), not the stack
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        kv = _stacked(k, v, q.shape[1])
        saved = None
        if ctx.rng is not None:
            saved = device.get_rng_state()
            device.set_rng_state(ctx.rng)
        try:
            dout = dout.contiguous()
            delta = (dout.float() * out.float()).sum(dim=-1)
            dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            dkv = attend_backward(q, kv, ctx.pieces, out, lse, dout, delta, dq, ctx.p, ctx.softcap)
        finally:
            if saved is not None:
                device.set_rng_state(saved)
        dkv = _fold(dkv.flatten(0, 1), k.shape[1]).unflatten(0, (2, k.shape[0])) if k.shape[1] != q.shape[1] else dkv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, backend: str,
                   documents: Documents | None = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention (``_causal``); with ``documents`` (q, k, v of the same s positions) attention stops at
    the document boundaries: each document is attended as its own sequence and the outputs concatenated.
    ``window`` (or the documents' own): a sliding window of that many keys. Training and prefill run it
    blockwise (``_Blockwise``: the cost follows the window) on every backend but 'unfused'/'local', which
    mask the reference softmax; decoding (keys beyond the queries) masks SDPA's input. ``softcap`` C > 0
    (--attn-logit-softcapping): scores C·tanh(s/C); training and prefill on the SDPA backends run blockwise
    then (with or without a window), 'unfused'/'local' and decoding the capped explicit softmax."""
    window = window or (documents.window if documents is not None else 0)
    if (window or softcap) and k.shape[2] == q.shape[2] and (softcap or window < q.shape[2]):
        if documents is None:
            documents = Documents.whole(q.shape[0], q.shape[2])
        documents = documents.with_window(window if window < q.shape[2] else 0)  # a window >= s is none
        if backend not in UNFUSED_BACKENDS:
            return _Blockwise.apply(q, k, v, documents, dropout_p, softcap)
    if documents is None or documents.uniform:
        return _causal(q, k, v, dropout_p, backend, window, softcap)
    if k.shape[2] != q.shape[2] or documents.seq_length != q.shape[2] or documents.batch != q.shape[0]:
        raise ValueError(f"document attention needs q, k, v of the documents' {documents.batch} x "
                         f"{documents.seq_length} positions, got q {list(q.shape)}, k {list(k.shape)}")
    if VARLEN and not window and not softcap and varlen.usable(q, dropout_p, backend):
        return varlen.varlen_attention(q, k, v, documents)
    # unbind and split (whose backwards are one stack and one concatenation), not slices (each of whose
    # backwards would fill a zero gradient of the whole tensor)
    rows = []
    for b, (qb, kb, vb) in enumerate(zip(q.unbind(0), k.unbind(0), v.unbind(0))):
        lengths = documents.lengths(b)
        parts = [_causal(qd[None], kd[None], vd[None], dropout_p, backend, window, softcap)
                 for qd, kd, vd in zip(*(t.split(lengths, dim=1) for t in (qb, kb, vb)))]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)
