"""All packed documents of a micro-batch in one call of CUDA's variable-length flash kernel.

The per-document path of ``core.py`` makes one kernel call per document; on CUDA in fp16/bf16 without
dropout the variable-length flash kernel takes the whole micro-batch as one stream of tokens with the
documents' cumulative lengths (``cu_seqlens``) and stays causal inside each: the same result in one
launch. Used by ``core_attention`` where ``compat.cuda_varlen_flash_attention`` finds the kernel and
--attention-backend is 'flash' or 'auto'; else the per-document calls run (the tested fallback). Proven
on a GPU only (tests/test_gpu_paths.py), since the kernel exists on CUDA alone.
"""

from __future__ import annotations

import torch

from megalite import compat
from megalite.attention.documents import Documents


def usable(q: torch.Tensor, dropout_p: float, backend: str) -> bool:
    """Whether the variable-length kernel serves this call."""
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and dropout_p == 0.0
            and backend in ("flash", "auto") and compat.cuda_varlen_flash_attention() is not None)


def _tokens(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, g, s, d] -> [b·s, heads, d] (K/V repeated to the query heads)."""
    b, g, s, d = t.shape
    if g != heads:
        t = t[:, :, None].expand(b, g, heads // g, s, d).reshape(b, heads, s, d)
    return t.permute(0, 2, 1, 3).reshape(b * s, heads, d).contiguous()


class _Varlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int
                ) -> torch.Tensor:
        b, h, s, d = q.shape
        qt, kt, vt = _tokens(q, h), _tokens(k, h), _tokens(v, h)
        out, lse, state = compat.cuda_varlen_flash_attention()[0](qt, kt, vt, cu, max_len)
        ctx.save_for_backward(qt, kt, vt, out, lse, cu)
        ctx.shape, ctx.groups, ctx.max_len, ctx.state = (b, h, s, d), k.shape[1], max_len, state
        return out.reshape(b, s, h, d).permute(0, 2, 1, 3)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        qt, kt, vt, out, lse, cu = ctx.saved_tensors
        b, h, s, d = ctx.shape
        g = ctx.groups
        dt = dout.permute(0, 2, 1, 3).reshape(b * s, h, d).contiguous()
        dq, dk, dv = compat.cuda_varlen_flash_attention()[1](dt, qt, kt, vt, out, lse, cu, ctx.max_len, ctx.state)

        def back(t: torch.Tensor, heads: int) -> torch.Tensor:
            t = t.reshape(b, s, h, d).permute(0, 2, 1, 3)
            return t if heads == h else t.reshape(b, heads, h // heads, s, d).sum(dim=2)
        return back(dq, h), back(dk, g), back(dv, g), None, None


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents) -> torch.Tensor:
    """Causal attention inside the documents, q [b, h, s, d], k, v [b, g, s, d], in one kernel call."""
    cu = [0]
    for b in range(documents.batch):
        cu += [b * documents.seq_length + e for e in documents.bounds[b][1:]]
    max_len = max(max(documents.lengths(b)) for b in range(documents.batch))
    return _Varlen.apply(q, k, v, torch.tensor(cu, dtype=torch.int32, device=q.device), max_len)
