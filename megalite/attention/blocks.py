"""Attention over one block of keys, for a softmax that spans several blocks (the log-sum-exp rule).

A block's forward returns its output normalised within the block and the block's log-sum-exp (fp32);
blocks merge exactly by ``merge`` into fp32 accumulators. The backward takes the final output and
log-sum-exp of the rows (nothing of size s x s is kept between passes) and uses delta = rowsum(dO * O),
which holds with dropout too: dropout on normalised probabilities is linear.

Each block is one ``Piece`` of ``documents.py``: causal (a square on the diagonal) or full. Kernels, in the
run's dtype (Q, K, V and O stay in it; only the log-sum-exp and the merge are fp32):
- the CPU flash kernel (``compat.cpu_flash_attention``), without dropout;
- CUDA's flash kernel (``compat.cuda_flash_attention``) in fp16/bf16 without dropout (proven on a GPU only);
- else the plain path: scores in fp32, ``ROW_TILE`` query rows at a time, the causal triangle cut inside
  each score tile; the reference, and the path with dropout.

Layout: q [b, h, sq, d]; k and v [b, g, sk, d] with h a multiple of g (GQA); dK/dV come back [b, g, sk, d].

Soft-capping (``softcap`` C > 0, --attn-logit-softcapping): every scaled score s becomes C·tanh(s/C) before
the masks and the softmax. No fused kernel takes it, so a capped block runs the plain path, whose backward
multiplies the score gradient by the cap's derivative 1 - tanh²(s/C) (recomputed from the scores).
"""

from __future__ import annotations

import torch

from megalite import compat

# The fused kernels may be switched off (tests run both paths; the plain one is the reference).
FUSED = True
# Query rows per score tile of the plain path: bounds the scores that exist at once to ROW_TILE x sk per head.
ROW_TILE = 1024


def _kernel(q: torch.Tensor, keep_p: float, band: tuple[int, int] | None = None, softcap: float = 0.0):
    """The fused (forward, backward) pair for this device and dtype, or None for the plain path (a band
    mask runs fused only on CPU, whose flash kernel takes a mask; no fused kernel soft-caps)."""
    if not FUSED or keep_p > 0 or softcap or (band is not None and q.device.type != "cpu"):
        return None
    if q.device.type == "cpu":
        return compat.cpu_flash_attention()
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        return compat.cuda_flash_attention()
    return None


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V [b, g, s, d] repeated to [b, heads, s, d] (the fused kernels take equal head counts)."""
    b, g, s, d = t.shape
    return t if g == heads else t[:, :, None].expand(b, g, heads // g, s, d).reshape(b, heads, s, d)


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """dK or dV [b, h, s, d] summed over the query heads of each group: [b, g, s, d]."""
    b, h, s, d = t.shape
    return t if h == groups else t.reshape(b, groups, h // groups, s, d).sum(dim=2)


def dropout_keep(q: torch.Tensor, sk: int, p: float) -> torch.Tensor | None:
    """The keep-scale factors (0 or 1/(1-p)) of one block [b, h, sq, sk], drawn from the default generator,
    so the backward redraws the same masks by replaying the generator state the forward started from."""
    if p == 0.0:
        return None
    return (torch.rand((*q.shape[:3], sk), device=q.device) >= p).float() / (1.0 - p)


def band_allowed(sq: int, sk: int, band: tuple[int, int], row0: int = 0, col0: int = 0,
                 device: torch.device | None = None) -> torch.Tensor:
    """[sq, sk] bool: row row0+t sees column col0+c when 0 <= (row0 + t) + lag - (col0 + c) < window, for
    band = (lag, window) (``documents.Piece``)."""
    lag, window = band
    d = (torch.arange(row0, row0 + sq, device=device)[:, None] + lag
         - torch.arange(col0, col0 + sk, device=device)[None, :])
    return (d >= 0) & (d < window)


def soft_cap(s: torch.Tensor, softcap: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(C·tanh(s/C), its derivative 1 - tanh²(s/C)) of scaled scores ``s`` for softcap = C > 0; (s, None)
    for 0. Applied before any mask, so a masked score stays -inf."""
    if not softcap:
        return s, None
    t = torch.tanh(s / softcap)
    return t * softcap, 1.0 - t * t


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, row0: int, band: tuple[int, int] | None = None,
            col0: int = 0, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(fp32 scores of query rows row0.. against keys col0.., the soft-cap's derivative or None); causal:
    column j > row i is -inf; a band leaves only the pairs it allows; ``softcap``: capped first."""
    s, dcap = soft_cap((q.float() @ _expand(k, q.shape[1]).float().transpose(-1, -2)) * q.shape[-1] ** -0.5,
                       softcap)
    if causal:
        rows = torch.arange(row0, row0 + q.shape[2], device=q.device)[:, None]
        s.masked_fill_(torch.arange(col0, col0 + k.shape[2], device=q.device)[None, :] > rows, float("-inf"))
    if band is not None:
        s.masked_fill_(~band_allowed(q.shape[2], k.shape[2], band, row0, col0, q.device), float("-inf"))
    return s, dcap


def _tiles(sq: int, sk: int, causal: bool, band: tuple[int, int] | None = None):
    """(rows, first key, key end) of each score tile: a causal tile sees only keys up to its last row, a
    banded one only the keys its rows' band reaches."""
    for a in range(0, sq, ROW_TILE):
        b = min(a + ROW_TILE, sq)
        k0, k1 = 0, (b if causal else sk)
        if band is not None:
            k0, k1 = max(0, a + band[0] - band[1] + 1), min(k1, b + band[0])
        yield slice(a, b), k0, k1


def _mask(q: torch.Tensor, sk: int, band: tuple[int, int] | None) -> torch.Tensor | None:
    """The CPU flash kernel's additive mask of a band ([sq, sk], 0 or -inf), or None."""
    if band is None:
        return None
    allowed = band_allowed(q.shape[2], sk, band, device=q.device)
    return torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, p: float = 0.0,
            band: tuple[int, int] | None = None, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, h, sq, d] in q's dtype, lse [b, h, sq] fp32) of one block; every row sees a key. ``band``:
    (lag, window) of a sliding window's band mask (``band_allowed``); ``softcap``: the logit cap C (0: none)."""
    kernel = _kernel(q, p, band, softcap)
    if kernel is not None:
        h = q.shape[1]
        if q.device.type == "cpu":
            out, lse = kernel[0](q, _expand(k, h), _expand(v, h), is_causal=causal,
                                 attn_mask=_mask(q, k.shape[2], band))
        else:
            out, lse = kernel[0](q, _expand(k, h).contiguous(), _expand(v, h).contiguous(), causal)
        return out, lse.float()
    keep = dropout_keep(q, k.shape[2], p)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for rows, kmin, kmax in _tiles(q.shape[2], k.shape[2], causal, band):
        kk, vv = k[:, :, kmin:kmax], v[:, :, kmin:kmax]
        s, _ = _scores(q[:, :, rows], kk, causal, rows.start, band, kmin, softcap)
        m = s.amax(dim=-1, keepdim=True)
        e = torch.exp(s - m)
        total = e.sum(dim=-1, keepdim=True)
        lse[:, :, rows] = (m + torch.log(total)).squeeze(-1)
        prob = e / total
        if keep is not None:
            prob = prob * keep[:, :, rows, kmin:kmax]
        out[:, :, rows] = prob @ _expand(vv, q.shape[1]).float()
    return out.to(q.dtype), lse


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block into the running fp32 (out, lse) in place. A row not reached yet has lse -inf; the
    block's rows all have a finite lse (each sees at least one key)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out.float() * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, out: torch.Tensor,
             lse: torch.Tensor, dout: torch.Tensor, delta: torch.Tensor, p: float = 0.0,
             band: tuple[int, int] | None = None, softcap: float = 0.0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (dq [b, h, sq, d], dk, dv [b, g, sk, d]) of one block given the final ``out`` and ``lse`` of its
    rows (out and dout in the run's dtype) and delta = rowsum(dout * out) in fp32; ``softcap`` as forward's."""
    kernel = _kernel(q, p, band, softcap)
    g, h = k.shape[1], q.shape[1]
    if kernel is not None:
        kx, vx = _expand(k, h), _expand(v, h)
        if q.device.type == "cpu":
            dq, dk, dv = kernel[1](dout, q, kx, vx, out, lse, 0.0, causal, attn_mask=_mask(q, k.shape[2], band))
        else:
            dq, dk, dv = kernel[1](dout.contiguous(), q, kx.contiguous(), vx.contiguous(), out, lse, causal)
        return dq.float(), _fold(dk.float(), g), _fold(dv.float(), g)
    keep = dropout_keep(q, k.shape[2], p)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros((q.shape[0], h, k.shape[2], q.shape[3]), dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    scale = q.shape[-1] ** -0.5
    for rows, kmin, kmax in _tiles(q.shape[2], k.shape[2], causal, band):
        cols = slice(kmin, kmax)
        kk, vv = _expand(k[:, :, cols], h).float(), _expand(v[:, :, cols], h).float()
        s, dcap = _scores(q[:, :, rows], k[:, :, cols], causal, rows.start, band, kmin, softcap)
        prob = torch.exp(s - lse[:, :, rows].unsqueeze(-1))
        do = dout[:, :, rows].float()
        dp = do @ vv.transpose(-1, -2)
        if keep is not None:
            kp = keep[:, :, rows, cols]
            dv[:, :, cols] += (prob * kp).transpose(-1, -2) @ do
            dp = dp * kp
        else:
            dv[:, :, cols] += prob.transpose(-1, -2) @ do
        ds = prob * (dp - delta[:, :, rows].unsqueeze(-1)) * scale
        if dcap is not None:  # through the cap: d(C·tanh(x/C))/dx = 1 - tanh²(x/C)
            ds = ds * dcap
        dq[:, :, rows] = ds @ kk
        dk[:, :, cols] += ds.transpose(-1, -2) @ q[:, :, rows].float()
    return dq, _fold(dk, g), _fold(dv, g)


def attend(q: torch.Tensor, kv: torch.Tensor, pieces: list, out: torch.Tensor, lse: torch.Tensor, p: float,
           softcap: float = 0.0) -> None:
    """Merge the pieces (``documents.Piece``, local offsets) of queries ``q`` against one holder's keys and
    values ``kv`` [2, b, g, sk, d] into the fp32 accumulators ``out`` and ``lse``, in order (dropout draws);
    ``softcap``: the logit cap C of every piece (0: none)."""
    for pc in pieces:
        rows, cols = slice(pc.q0, pc.q1), slice(pc.k0, pc.k1)
        qq, kk, vv = q[pc.batch, :, rows], kv[0][pc.batch, :, cols], kv[1][pc.batch, :, cols]
        if pc.flip:  # row t sees columns t..: the causal square of the reversed rows and columns
            o, lb = forward(qq.flip(2), kk.flip(2), vv.flip(2), True, p, softcap=softcap)
            o, lb = o.flip(2), lb.flip(2)
        else:
            o, lb = forward(qq, kk, vv, pc.causal, p, (pc.lag, pc.window) if pc.window else None, softcap)
        merge(out[pc.batch, :, rows], lse[pc.batch, :, rows], o, lb)


def attend_backward(q: torch.Tensor, kv: torch.Tensor, pieces: list, out: torch.Tensor, lse: torch.Tensor,
                    dout: torch.Tensor, delta: torch.Tensor, dq: torch.Tensor, p: float, softcap: float = 0.0
                    ) -> torch.Tensor:
    """Add the pieces' part to the fp32 ``dq``; return their fp32 dK/dV [2, b, g, sk, d] for the holder's keys
    (pieces in the forward's order, so dropout redraws the same masks; ``softcap`` as ``attend``'s)."""
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    for pc in pieces:
        rows, cols, bs = slice(pc.q0, pc.q1), slice(pc.k0, pc.k1), pc.batch
        args = (q[bs, :, rows], kv[0][bs, :, cols], kv[1][bs, :, cols], pc.causal, out[bs, :, rows],
                lse[bs, :, rows], dout[bs, :, rows], delta[bs, :, rows])
        if pc.flip:  # the mirrored causal square (see ``attend``)
            dq_b, dk, dv = (t.flip(2) for t in backward(*(t.flip(2) for t in args[:3]), True,
                                                        *(t.flip(2) for t in args[4:]), p, softcap=softcap))
        else:
            dq_b, dk, dv = backward(*args, p, (pc.lag, pc.window) if pc.window else None, softcap)
        dq[bs, :, rows] += dq_b
        dkv[0][bs, :, cols] += dk
        dkv[1][bs, :, cols] += dv
    return dkv
