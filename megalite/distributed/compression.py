"""Compressed gradient all-reduce over data parallelism (--grad-compression powersgd|int8).

GradBuffer hands each bucket's all-reduce (or, with --hierarchical-dp-reduce, only its inter-node part)
to ``GradCompressor.all_reduce``. For the first --grad-compression-warmup-steps reductions of a bucket it
declines and the exact all-reduce runs. After that the bucket is compressed with error feedback: what the
compression lost on this rank is added to the bucket's next gradient, so the sum of the applied updates
tracks the sum of the true gradients (the error never accumulates; Karimireddy et al., Vogels et al.).
That state (each bucket's error, PowerSGD's Q, the reductions counted for the warm-up) is saved with a
checkpoint (``state``/``load_state``), so a resumed run continues the uninterrupted one exactly.

- ``powersgd``: every weight matrix of the bucket in its own shape (rows x cols; a bucket handed over
  without its layout, the inter-node shard of --hierarchical-dp-reduce, is one zero-padded matrix with
  cols = ceil(sqrt(n))); one power iteration with a warm-started Q per matrix: P = sum_i M_i Q
  (all-reduce), orthonormalise P, Q = sum_i M_i^T P (all-reduce), sum_i M_i ~ P Q^T. Vectors (biases,
  norm weights) travel exact with the P all-reduce. Bytes: 4 (sum r (rows + cols) + vector elements)
  instead of 4 n. At full rank r = min(rows, cols) it is exact up to rounding. Error: M_i - P Q^T / d
  (each rank keeps its share of the miss); none on the exact vectors.
- ``int8``: each rank quantises its bucket to int8 in d chunks (one fp32 scale per chunk, absmax / 127),
  an all-to-all hands every rank the d versions of its chunk, which it sums in fp32, re-quantises and
  all-gathers. Bytes: 2 n + 8 d (int8 payload both ways, the scales) instead of 4 n. Error: this rank's
  quantisation error, plus the re-quantisation error of the chunk it owns.

A non-finite gradient (an fp16 overflow) comes out non-finite, so every rank skips the step as without
compression; the bucket's error and PowerSGD's Q then restart from zero and the seeded start.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from megalite import device
from megalite.parallel.groups import ProcessGroups

METHODS = ("none", "powersgd", "int8")


def matrix_shape(n: int) -> tuple[int, int]:
    """(rows, cols) of the matrix a bucket of ``n`` elements is viewed as for PowerSGD."""
    cols = max(1, math.ceil(math.sqrt(n)))
    return math.ceil(n / cols), cols


Layout = list[tuple[int, int, int]]  # (offset, rows, cols) of each matrix inside a bucket


def matrix_layout(params: list, ranges: dict, start: int) -> Layout:
    """Where the weight matrices (2-D and up, as rows x the rest) of a bucket's ``params`` lie in it, from
    GradBuffer's ``ranges`` and the bucket's ``start``."""
    return [(ranges[p][0] - start, p.shape[0], p.numel() // p.shape[0]) for p in params if p.ndim >= 2]


def _plan(n: int, layout: Layout | None) -> tuple[Layout, int]:
    """The matrices PowerSGD compresses and the number of elements it sends exact."""
    if layout is None:
        rows, cols = matrix_shape(n)
        return [(0, rows, cols)], 0
    return layout, n - sum(r * c for _, r, c in layout)


def powersgd_bytes(n: int, rank: int, layout: Layout | None = None) -> int:
    """DP bytes of one compressed PowerSGD reduction of ``n`` elements (P, Q and the exact vectors, fp32)."""
    mats, exact = _plan(n, layout)
    return 4 * (sum(min(rank, r, c) * (r + c) for _, r, c in mats) + exact)


def int8_bytes(n: int, d: int) -> int:
    """DP bytes of one int8 reduction of ``n`` elements over ``d`` ranks (payload both ways, fp32 scales)."""
    chunk = -(-n // d)
    return 2 * d * chunk + 2 * 4 * d


class GradCompressor:
    """Per-bucket compression state: reductions seen, error feedback, PowerSGD's warm-started Q."""

    def __init__(self, method: str, pg: ProcessGroups, *, rank: int = 1, warmup_steps: int = 0,
                 error_feedback: bool = True) -> None:
        if method not in METHODS[1:]:
            raise ValueError(f"--grad-compression must be one of {', '.join(METHODS)}, got {method!r}")
        self.method, self.pg, self.rank, self.warmup = method, pg, rank, warmup_steps
        self.error_feedback = error_feedback  # off only in tests that show what it buys
        self.calls: Counter = Counter()
        self.errors: dict = {}
        self.qs: dict = {}
        self.calls_floor = 0  # reductions already done by the run this one resumed without its state

    # ---- checkpoint state -------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """What a checkpoint stores, by bucket key (an int: the bucket's start in its buffer): the live
        tensors (an asynchronous save copies them) and, as JSON, the method and reductions counted."""
        tensors = {f"{key}/error": e for key, e in self.errors.items()}
        tensors.update({f"{key}/q{j}": q for key, qs in self.qs.items() for j, q in enumerate(qs)})
        calls = {str(key): n for key, n in self.calls.items()}
        return tensors, {"method": self.method, "rank": self.rank, "calls": calls, "floor": self.calls_floor}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Restore what ``state`` returned (same method, rank and buckets: the caller checks the layout)."""
        self.calls = Counter({int(k): int(n) for k, n in meta["calls"].items()})
        self.calls_floor = int(meta.get("floor", 0))
        dev = device.current_device()
        self.errors = {int(k.split("/")[0]): t.to(dev) for k, t in tensors.items() if k.endswith("/error")}
        qs: dict[int, dict[int, torch.Tensor]] = {}
        for k, t in tensors.items():
            key, _, name = k.partition("/")
            if name.startswith("q"):
                qs.setdefault(int(key), {})[int(name[1:])] = t.to(dev)
        self.qs = {key: [by_j[j] for j in sorted(by_j)] for key, by_j in qs.items()}

    def reset(self, reductions: int) -> None:
        """Start the error feedback and Q afresh (state that cannot be carried into this layout), counting
        ``reductions`` as done so that the warm-up is not run again."""
        self.errors, self.qs, self.calls = {}, {}, Counter()
        self.calls_floor = reductions

    def all_reduce(self, data: torch.Tensor, kind: str, key: object, layout: Layout | None = None) -> bool:
        """Sum ``data`` over group ``kind`` in place, compressed; False (nothing done) during the warm-up.
        ``layout``: the weight matrices in ``data`` (PowerSGD compresses each in its shape)."""
        self.calls[key] = max(self.calls[key], self.calls_floor) + 1
        if self.calls[key] <= self.warmup:
            return False
        m = data.reshape(-1).float()
        if self.error_feedback and key in self.errors:
            m = m + self.errors[key]
        if self.method == "powersgd":
            out, err = self._powersgd(m, kind, key, layout)
        else:
            out, err = self._int8(m, kind, key)
        finite = bool(torch.isfinite(err).all())
        if self.error_feedback:
            self.errors[key] = err if finite else torch.zeros_like(err)
        if not finite:
            self.qs.pop(key, None)
        data.copy_(out.view_as(data))
        return True

    # ---- PowerSGD -------------------------------------------------------------------------------
    def _start_qs(self, key: object, mats: Layout, dev: torch.device) -> list[torch.Tensor]:
        if key not in self.qs:  # the same seeded start on every rank
            gen = torch.Generator().manual_seed(1234)
            self.qs[key] = [torch.randn(c, min(self.rank, r, c), generator=gen).to(dev) for _, r, c in mats]
        return self.qs[key]

    def _powersgd(self, m: torch.Tensor, kind: str, key: object, layout: Layout | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        n = m.numel()
        mats, _ = _plan(n, layout)
        padded = torch.nn.functional.pad(m, (0, max(0, mats[0][1] * mats[0][2] - n))) if layout is None else m
        views = [padded[o:o + r * c].view(r, c) for o, r, c in mats]
        exact = torch.ones(n, dtype=torch.bool, device=m.device)
        for o, r, c in mats:
            exact[o:o + r * c] = False
        ps = [v @ q for v, q in zip(views, self._start_qs(key, mats, m.device))]
        sent = torch.cat([p.reshape(-1) for p in ps] + [m[exact]])
        self.pg.all_reduce(sent, kind, label="grad_powersgd_p")
        parts = list(sent.split([p.numel() for p in ps] + [int(exact.sum())]))
        ps = [torch.linalg.qr(part.view_as(p), mode="reduced").Q for part, p in zip(parts, ps)]
        qs = [v.t() @ p for v, p in zip(views, ps)]
        sent_q = torch.cat([q.reshape(-1) for q in qs])
        self.pg.all_reduce(sent_q, kind, label="grad_powersgd_q")
        qs = [part.view_as(q) for part, q in zip(sent_q.split([q.numel() for q in qs]), qs)]
        self.qs[key] = qs
        out = torch.empty_like(padded)
        for (o, r, c), p, q in zip(mats, ps, qs):
            out[o:o + r * c] = (p @ q.t()).reshape(-1)
        out = out[:n]
        out[exact] = parts[-1]
        err = m - out / self.pg.size(kind)
        err[exact] = 0.0
        return out, err

    # ---- int8 ----------------------------------------------------------------------------------
    @staticmethod
    def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``x`` to int8 with one scale per row (absmax / 127; 1 for an all-zero row)."""
        absmax = x.abs().amax(dim=-1)
        scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
        scale = torch.where(torch.isfinite(scale), scale, torch.full_like(scale, float("nan")))
        q = torch.round(x / scale.unsqueeze(-1)).clamp_(-127, 127)
        return torch.nan_to_num(q).to(torch.int8), scale

    @staticmethod
    def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return q.float() * scale.unsqueeze(-1)

    def _int8(self, m: torch.Tensor, kind: str, key: object) -> tuple[torch.Tensor, torch.Tensor]:
        n, d, me = m.numel(), self.pg.size(kind), self.pg.index(kind)
        chunk = -(-n // d)
        chunks = torch.nn.functional.pad(m, (0, d * chunk - n)).view(d, chunk)
        q, scale = self.quantize(chunks)
        err = chunks - self.dequantize(q, scale)
        q_in, s_in = torch.empty_like(q), torch.empty_like(scale)
        self.pg.all_to_all_flat(q_in.view(-1), q.view(-1), kind, label="grad_int8_all_to_all")
        self.pg.all_to_all_flat(s_in, scale, kind, label="grad_int8_all_to_all")
        mine = self.dequantize(q_in, s_in).sum(dim=0)  # this rank's chunk, summed over the group
        q2, s2 = self.quantize(mine.unsqueeze(0))
        err[me] += mine - self.dequantize(q2, s2)[0]
        q_all, s_all = torch.empty_like(q), torch.empty_like(scale)
        self.pg.all_gather_flat(q_all.view(-1), q2.view(-1), kind, label="grad_int8_all_gather")
        self.pg.all_gather_flat(s_all, s2, kind, label="grad_int8_all_gather")
        out = self.dequantize(q_all, s_all).view(-1)[:n]
        return out, err.view(-1)[:n]


def make_compressor(method: str, pg: ProcessGroups, rank: int, warmup_steps: int) -> GradCompressor | None:
    """The compressor --grad-compression asks for (None: exact all-reduce, or a one-rank DP group)."""
    if method == "none" or pg.grad_size == 1:
        return None
    return GradCompressor(method, pg, rank=rank, warmup_steps=warmup_steps)
