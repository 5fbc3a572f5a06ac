"""Contiguous gradient (and parameter) buffers cut into buckets, reduced over data parallelism.

Every parameter's gradient is a view into one flat buffer (``param.main_grad``; for fp32 models also
``param.grad``, so autograd accumulates in place across micro-batches). Buckets are contiguous ranges of
the buffer in backward order; during the last micro-batch's backward a bucket's reduction starts as soon
as its last gradient is ready (``--overlap-grad-reduce``); otherwise all buckets are reduced when the
step finishes. Either way the buffer is reduced once per step, not per micro-batch.

With the distributed optimizer each bucket is padded to a multiple of the DP size and reduce-scattered:
DP rank r owns the r-th contiguous shard of every bucket. Parameters live in a matching flat buffer so
the updated shards can be all-gathered straight into the model's weights.

With ``--hierarchical-dp-reduce`` (``pg.hierarchical_dp``) a DP group of k ranks on each of n nodes
reduces in steps: reduce-scatter over the k ranks inside the node, then over the n nodes only the
1/k shard crosses the network (all-reduce; or a reduce-scatter, with the distributed optimizer), then
an all-gather inside the node (all-reduce path only). The first step overlaps with backward like the
flat reduction; the rest runs in ``finish_grad_sync``. Same sum, different addition order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from megalite.distributed.compression import GradCompressor, Layout, matrix_layout
from megalite.parallel.groups import Group, ProcessGroups


@dataclass
class Bucket:
    start: int
    end: int
    params: list[nn.Parameter]
    ready: set = field(default_factory=set)
    work: object = None
    shard_out: torch.Tensor | None = None
    intra_out: torch.Tensor | None = None  # hierarchical: this rank's part after the intra-node step

    @property
    def numel(self) -> int:
        return self.end - self.start


def default_bucket_size(dp: int) -> int:
    return max(40_000_000, 1_000_000 * dp)


class GradBuffer:
    """One model chunk's gradient buffer and its DP reduction."""

    def __init__(self, params: list[nn.Parameter], pg: ProcessGroups, *, grad_dtype: torch.dtype,
                 bucket_size: int | None = None, distributed: bool = False, overlap: bool = False,
                 separate: list[nn.Parameter] | None = None, compressor: GradCompressor | None = None) -> None:
        """``separate``: parameters that get a bucket of their own at the start of the buffer (a tied
        embedding, so that both of its copies shard identically over DP). ``compressor``: --grad-compression
        (all-reduce path only)."""
        self.pg, self.distributed, self.overlap = pg, distributed, overlap
        self.compressor = compressor
        self.dp = pg.dp_size
        self.hierarchical = pg.hierarchical_dp and self.dp > 1
        bucket_size = bucket_size or default_bucket_size(self.dp)
        align = self.dp if distributed else pg.size(Group.DP_INTRA) if self.hierarchical else 1
        separate = [p for p in (separate or []) if p.requires_grad]
        rest = [p for p in reversed(params) if p.requires_grad and all(p is not s for s in separate)]
        groups: list[list[nn.Parameter]] = [[p] for p in separate]
        current: list[nn.Parameter] = []
        for p in rest:  # backward order: the last layers' grads are ready first
            current.append(p)
            if sum(q.numel() for q in current) >= bucket_size:
                groups.append(current)
                current = []
        if current:
            groups.append(current)

        self.ranges: dict[nn.Parameter, tuple[int, int]] = {}
        self.buckets: list[Bucket] = []
        offset = 0
        for group in groups:
            start = offset
            for p in group:
                self.ranges[p] = (offset, offset + p.numel())
                offset += p.numel()
            offset = -(-offset // align) * align  # pad so every DP rank's shard is equal
            self.buckets.append(Bucket(start, offset, group))
        self.numel = offset
        device = params[0].device if params else torch.device("cpu")
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.param_data: torch.Tensor | None = None
        if distributed:  # params become views of one flat buffer, the target of the all-gather
            self.param_data = torch.zeros(self.numel, dtype=params[0].dtype, device=device)
            for p, (s, e) in self.ranges.items():
                self.param_data[s:e].copy_(p.data.view(-1))
                p.data = self.param_data[s:e].view(p.shape)
        self.bucket_of: dict[nn.Parameter, Bucket] = {}
        for b in self.buckets:
            for p in b.params:
                self.bucket_of[p] = b
        for p, (s, e) in self.ranges.items():
            p.main_grad = self.grad_data[s:e].view(p.shape)
            if p.dtype == grad_dtype:
                p.grad = p.main_grad  # autograd accumulates into the buffer in place
            p.register_post_accumulate_grad_hook(self._hook)
        self.last_microbatch = True

    # ---- ownership (distributed optimizer) ----------------------------------------------------
    def shard_range(self, bucket: Bucket) -> tuple[int, int]:
        """Buffer range of this DP rank's shard of ``bucket``."""
        if not self.distributed:
            return bucket.start, bucket.end
        size = bucket.numel // self.dp
        start = bucket.start + self.pg.dp_rank * size
        return start, start + size

    def owned_region(self, param: nn.Parameter) -> tuple[int, int] | None:
        """The part [lo, hi) of ``param``'s flat elements whose update this rank owns (None: none)."""
        s, e = self.ranges[param]
        lo, hi = self.shard_range(self.bucket_of[param])
        lo, hi = max(s, lo), min(e, hi)
        return (lo - s, hi - s) if lo < hi else None

    # ---- gradient accumulation and reduction --------------------------------------------------
    def _hook(self, p: nn.Parameter) -> None:
        if p.grad is not None and p.grad.data_ptr() != p.main_grad.data_ptr():  # low precision: add into fp32
            p.main_grad.add_(p.grad)
            p.grad = None
        if self.overlap and self.last_microbatch:
            bucket = self.bucket_of[p]
            bucket.ready.add(id(p))
            if len(bucket.ready) == len(bucket.params):
                self._start(bucket)

    def _start(self, bucket: Bucket) -> None:
        if bucket.work is not None or self.dp == 1:
            return
        data = self.grad_data[bucket.start:bucket.end]
        data.mul_(1.0 / self.dp)
        if self.hierarchical:
            self._start_hierarchical(bucket, data)
        elif self.distributed:
            bucket.shard_out = torch.empty(bucket.numel // self.dp, dtype=data.dtype, device=data.device)
            bucket.work = self.pg.reduce_scatter_flat(bucket.shard_out, data, Group.DP, async_op=True,
                                                      label="grad_reduce_scatter")
        else:
            bucket.work = self._all_reduce(bucket, data, Group.DP, async_op=True,
                                           layout=matrix_layout(bucket.params, self.ranges, bucket.start))

    def _all_reduce(self, bucket: Bucket, data: torch.Tensor, kind: str, async_op: bool = False,
                    layout: Layout | None = None):
        """A bucket's all-reduce (hierarchical: its inter-node part), compressed (synchronously) when
        --grad-compression is on and past its warm-up; ``layout``: its weight matrices (PowerSGD)."""
        if self.compressor is not None and self.compressor.all_reduce(data, kind, bucket.start, layout):
            return _Done() if async_op else None
        return self.pg.all_reduce(data, kind, async_op=async_op, label="grad_all_reduce")

    # ---- hierarchical reduction (--hierarchical-dp-reduce) ------------------------------------
    def _start_hierarchical(self, bucket: Bucket, data: torch.Tensor) -> None:
        """Step 1, asynchronous: reduce-scatter inside the node."""
        k, n = self.pg.size(Group.DP_INTRA), self.pg.size(Group.DP_INTER)
        if self.distributed:
            # DP index d = node * k + j owns shard d. Reorder [n, k, S] -> [k, n, S] so that the intra-node
            # reduce-scatter hands position j the shards of every node, and the inter-node one then shard d.
            data = data.view(n, k, -1).transpose(0, 1).contiguous().view(-1)  # [k * n * S]
        if k == 1:
            bucket.intra_out, bucket.work = data, _Done()
            return
        bucket.intra_out = torch.empty(data.numel() // k, dtype=data.dtype, device=data.device)
        bucket.work = self.pg.reduce_scatter_flat(bucket.intra_out, data, Group.DP_INTRA, async_op=True,
                                                  label="grad_reduce_scatter")

    def _finish_hierarchical(self, bucket: Bucket) -> None:
        """Steps 2 and 3: across nodes on the 1/k shard, then (all-reduce path) all-gather inside the node."""
        k, n = self.pg.size(Group.DP_INTRA), self.pg.size(Group.DP_INTER)
        part = bucket.intra_out  # [numel / k], summed over this node's DP ranks
        if self.distributed:
            shard = part
            if n > 1:
                shard = torch.empty(part.numel() // n, dtype=part.dtype, device=part.device)
                self.pg.reduce_scatter_flat(shard, part, Group.DP_INTER, label="grad_reduce_scatter")
            lo, hi = self.shard_range(bucket)
            self.grad_data[lo:hi].copy_(shard)
            return
        if n > 1:
            self._all_reduce(bucket, part, Group.DP_INTER)
        if k > 1:
            data = self.grad_data[bucket.start:bucket.end]
            self.pg.all_gather_flat(data, part, Group.DP_INTRA, label="grad_all_gather")

    def start_grad_sync(self) -> None:
        """Launch the reduction of every bucket not yet launched."""
        for b in self.buckets:
            self._start(b)

    def finish_grad_sync(self) -> None:
        """Wait for every bucket's reduction (launching any that are left)."""
        self.start_grad_sync()
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                if b.intra_out is not None:
                    self._finish_hierarchical(b)
                elif b.shard_out is not None:
                    lo, hi = self.shard_range(b)
                    self.grad_data[lo:hi].copy_(b.shard_out)
            b.work, b.shard_out, b.intra_out = None, None, None
            b.ready.clear()

    def zero_grad(self) -> None:
        self.grad_data.zero_()
        for p in self.ranges:
            p.grad = p.main_grad if p.dtype == self.grad_data.dtype else None

    # ---- parameter all-gather (distributed optimizer) -----------------------------------------
    def start_param_gather(self) -> list:
        """All-gather every bucket's updated shards into the parameter buffer (async handles)."""
        works = []
        if not self.distributed or self.dp == 1:
            return works
        for b in self.buckets:
            lo, hi = self.shard_range(b)
            shard = self.param_data[lo:hi].clone()
            out = self.param_data[b.start:b.end]
            works.append(self.pg.all_gather_flat(out, shard, Group.DP, async_op=True, label="param_all_gather"))
        return works


class _Done:
    """A finished work handle (a one-rank intra-node step has nothing to wait for)."""

    def wait(self) -> bool:
        return True
