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

With sharded gradients (``--data-parallel-sharding-strategy optim_grads``/``optim_grads_params``, ZeRO-2/3)
no full buffer is kept: autograd writes each micro-batch's gradients into ``param.grad``; as soon as a
bucket's last one is ready its gradients are flattened, TP partials summed, and the bucket is
reduce-scattered into ``grad_data``, which then holds only this rank's shards (numel / d). The DP
traffic is m reduce-scatters per step (m micro-batches) instead of one; in exchange a full gradient
never outlives its bucket's backward. With sharded parameters (ZeRO-3) ``param_shard`` holds this
rank's shard of every bucket's weights; megalite/distributed/param_shard.py gathers and frees the full
ones around each layer's use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from megalite.distributed.compression import GradCompressor, Layout, matrix_layout
from megalite.parallel.groups import Group, ProcessGroups
from megalite.parallel.loss_scaling import LossScaling
from megalite.tensor_parallel.param_meta import param_meta


@dataclass
class Bucket:
    start: int
    end: int
    params: list[nn.Parameter]
    ready: set = field(default_factory=set)
    work: object = None
    shard_out: torch.Tensor | None = None
    intra_out: torch.Tensor | None = None  # hierarchical: this rank's part after the intra-node step
    pending: list = field(default_factory=list)  # sharded grads: (work, shard out, flat input) in flight

    @property
    def numel(self) -> int:
        return self.end - self.start


def default_bucket_size(dp: int) -> int:
    return max(40_000_000, 1_000_000 * dp)


class GradBuffer:
    """One model chunk's gradient buffer and its DP reduction."""

    def __init__(self, params: list[nn.Parameter], pg: ProcessGroups, *, grad_dtype: torch.dtype,
                 bucket_size: int | None = None, distributed: bool = False, overlap: bool = False,
                 separate: list[nn.Parameter] | None = None, shard_grads: bool = False,
                 units: list[list[nn.Parameter]] | None = None, compressor: GradCompressor | None = None,
                 kind: str | None = None, chunk: int = 0) -> None:
        """``separate``: parameters that get a bucket of their own at the start of the buffer (a tied
        embedding, so that both of its copies shard identically over DP). ``shard_grads`` (needs
        ``distributed``): keep only this rank's gradient shards (ZeRO-2). ``units`` (ZeRO-3, forward order):
        groups of parameters gathered together; each is its own buckets, and the parameters live sharded.
        ``compressor``: --grad-compression (all-reduce path only). ``kind``: the group reduced (and sharded)
        over, default ``pg.grad_kind``; routed experts' buffers use expert-DP (``Group.EDP``), and their
        sums are still divided by the gradient group's size, because together the expert-DP replicas saw
        every token of the stage once. ``chunk``: the model chunk the parameters belong to."""
        self.pg, self.overlap, self.compressor, self.chunk = pg, overlap, compressor, chunk
        # DP, or DP x CP with context parallelism: gradients reduced and sharded over it
        self.kind = kind or pg.grad_kind
        self.dp = pg.size(self.kind)
        self.scale = LossScaling.of(pg).grad_factor  # each rank's gradients are sums over its own tokens
        self.distributed = distributed and self.dp > 1
        self.shard_grads = (shard_grads or units is not None) and self.distributed
        self.shard_params = units is not None and self.distributed
        self.hierarchical = pg.hierarchical_dp and self.dp > 1
        self.align = self.dp if self.distributed else pg.size(Group.DP_INTRA) if self.hierarchical else 1
        self.separate = [p for p in (separate or []) if p.requires_grad]
        self.unit_buckets: list[list[Bucket]] = []
        self.buckets: list[Bucket] = []
        self.ranges: dict[nn.Parameter, tuple[int, int]] = {}
        self.numel = 0
        if units is not None and self.shard_params:
            for unit in reversed(units):  # backward order
                self.unit_buckets.insert(0, self._add_buckets(unit, None))
        else:
            self._add_buckets(params, bucket_size or default_bucket_size(self.dp))
        device = params[0].device if params else torch.device("cpu")
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.grad_data = torch.zeros(self.numel // self.dp if self.shard_grads else self.numel, dtype=grad_dtype,
                                     device=device)
        self.param_data: torch.Tensor | None = None  # ZeRO-1/2: the full flat parameters
        self.param_shard: torch.Tensor | None = None  # ZeRO-3: this rank's shard of them
        if self.distributed:
            self._flatten_params(params[0].dtype, device)
        for p, (s, e) in self.ranges.items():
            if not self.shard_grads:
                p.main_grad = self.grad_data[s:e].view(p.shape)
                if p.dtype == grad_dtype:
                    p.grad = p.main_grad  # autograd accumulates into the buffer in place
            p.register_post_accumulate_grad_hook(self._sharded_hook if self.shard_grads else self._hook)
        self.last_microbatch = True
        self.on_reduced = None  # ZeRO-3: called with each bucket once its micro-batch gradients are reduced
        self.param_gatherer = None  # ZeRO-3: the chunk's ParamGatherer (megalite/distributed/param_shard.py)

    def _add_buckets(self, params: list[nn.Parameter], bucket_size: int | None) -> list[Bucket]:
        """Buckets for ``params`` in backward order (``separate`` ones first, one each), appended to the
        buffer; ``bucket_size`` None: one bucket for the rest."""
        separate = [p for p in params if p.requires_grad and any(p is s for s in self.separate)]
        rest = [p for p in reversed(params) if p.requires_grad and all(p is not s for s in separate)]
        groups: list[list[nn.Parameter]] = [[p] for p in separate]
        current: list[nn.Parameter] = []
        for p in rest:  # backward order: the last layers' grads are ready first
            current.append(p)
            if bucket_size is not None and sum(q.numel() for q in current) >= bucket_size:
                groups.append(current)
                current = []
        if current:
            groups.append(current)
        added = []
        for group in groups:
            start = self.numel
            for p in group:
                self.ranges[p] = (self.numel, self.numel + p.numel())
                self.numel += p.numel()
            self.numel = -(-self.numel // self.align) * self.align  # pad so every DP rank's shard is equal
            added.append(Bucket(start, self.numel, group))
        self.buckets += added
        return added

    @torch.no_grad()
    def _flatten_params(self, dtype: torch.dtype, device: torch.device) -> None:
        """ZeRO-1/2: params become views of one flat buffer, the target of the all-gather. ZeRO-3: only
        this rank's shard is kept; the params hold a placeholder until gathered."""
        full = torch.zeros(self.numel, dtype=dtype, device=device)
        for p, (s, e) in self.ranges.items():
            full[s:e].copy_(p.data.view(-1))
            p.data = full[s:e].view(p.shape)
        if not self.shard_params:
            self.param_data = full
            return
        self.param_shard = torch.cat([full[slice(*self.shard_range(b))] for b in self.buckets])
        for p in self.ranges:
            p.data = placeholder(p.shape, dtype, device)

    # ---- ownership (distributed optimizer) ----------------------------------------------------
    def shard_range(self, bucket: Bucket) -> tuple[int, int]:
        """Buffer range of this DP rank's shard of ``bucket``."""
        if not self.distributed:
            return bucket.start, bucket.end
        size = bucket.numel // self.dp
        start = bucket.start + self.pg.index(self.kind) * size
        return start, start + size

    def shard_offset(self, bucket: Bucket) -> int:
        """Where ``bucket``'s shard starts in the sharded storage (``grad_data`` with sharded grads,
        ``param_shard``): the shards of all buckets, in buffer order."""
        return bucket.start // self.dp

    def _slice(self, param: nn.Parameter, lo: int, hi: int, sharded: torch.Tensor) -> torch.Tensor:
        s, _ = self.ranges[param]
        bucket = self.bucket_of[param]
        off = s + lo - self.shard_range(bucket)[0] + self.shard_offset(bucket)
        return sharded[off: off + hi - lo]

    def grad_slice(self, param: nn.Parameter, lo: int, hi: int) -> torch.Tensor:
        """The reduced gradient of ``param``'s owned flat region [lo, hi) (a view, valid every step)."""
        if self.shard_grads:
            return self._slice(param, lo, hi, self.grad_data)
        return param.main_grad.view(-1)[lo:hi]

    def param_slice(self, param: nn.Parameter, lo: int, hi: int) -> torch.Tensor:
        """The model weights of ``param``'s owned flat region [lo, hi), where the update is written."""
        if self.shard_params:
            return self._slice(param, lo, hi, self.param_shard)
        return param.data.view(-1)[lo:hi]

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
            self._count_ready(p)

    def mark_ready(self, params: list[nn.Parameter]) -> None:
        """With --overlap-grad-reduce, count ``params`` as done for this step (a split backward: their
        gradients, computed in B, are complete before the last W adds the others'); a bucket whose every
        parameter is done starts reducing. ZeRO-2/3 reduce per micro-batch and need no count."""
        if not self.overlap or self.shard_grads:
            return
        for p in params:
            self._count_ready(p)

    def _count_ready(self, p: nn.Parameter) -> None:
        bucket = self.bucket_of[p]
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params):
            self._start(bucket)

    def _sharded_hook(self, p: nn.Parameter) -> None:
        bucket = self.bucket_of[p]
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params):
            self._reduce_scatter_microbatch(bucket)

    @torch.no_grad()
    def _reduce_scatter_microbatch(self, bucket: Bucket) -> None:
        """This micro-batch's gradients of ``bucket``: TP partials summed, then reduce-scattered and added
        into this rank's shard; ``param.grad`` is freed."""
        flat = torch.zeros(bucket.numel, dtype=self.grad_data.dtype, device=self.grad_data.device)
        for p in bucket.params:
            if p.grad is None:  # unused in this micro-batch
                continue
            s, e = self.ranges[p]
            part = flat[s - bucket.start: e - bucket.start]
            part.copy_(p.grad.reshape(-1))
            param_meta(p).spec.finalize_grad(part.view(p.grad.shape), self.pg)
            p.grad = None
        flat.mul_(self.scale)
        for b in self.buckets:  # overlap: one bucket in flight while the next one's gradients are computed
            self._drain(b)
        out = torch.empty(bucket.numel // self.dp, dtype=flat.dtype, device=flat.device)
        work = self.pg.reduce_scatter_flat(out, flat, self.kind, async_op=self.overlap, label="grad_reduce_scatter")
        bucket.pending.append((work, out, flat))
        if not self.overlap:
            self._drain(bucket)
        bucket.ready.clear()
        if self.on_reduced is not None:
            self.on_reduced(bucket)

    def _drain(self, bucket: Bucket) -> None:
        """Wait for ``bucket``'s reduce-scatter, if one is in flight, and add it into the gradient shard."""
        if not bucket.pending:
            return
        lo = self.shard_offset(bucket)
        for work, out, _ in bucket.pending:
            if work is not None:
                work.wait()
            self.grad_data[lo: lo + out.numel()].add_(out)
        bucket.pending = []

    def _start(self, bucket: Bucket) -> None:
        if bucket.work is not None:
            return
        data = self.grad_data[bucket.start:bucket.end]
        if self.dp == 1:  # nothing to reduce; an expert buffer still averages over the gradient group
            if self.scale != 1.0:
                data.mul_(self.scale)
                bucket.work = _Done()
            return
        data.mul_(self.scale)
        if self.hierarchical:
            self._start_hierarchical(bucket, data)
        elif self.distributed:
            bucket.shard_out = torch.empty(bucket.numel // self.dp, dtype=data.dtype, device=data.device)
            bucket.work = self.pg.reduce_scatter_flat(bucket.shard_out, data, self.kind, async_op=True,
                                                      label="grad_reduce_scatter")
        else:
            bucket.work = self._all_reduce(bucket, data, self.kind, async_op=True,
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
        if self.shard_grads:
            return
        for b in self.buckets:
            self._start(b)

    def finish_grad_sync(self) -> None:
        """Wait for every bucket's reduction (launching any that are left)."""
        if self.shard_grads:
            for b in self.buckets:
                if b.ready:  # some parameter had no gradient in the last micro-batch
                    self._reduce_scatter_microbatch(b)
                self._drain(b)
            if self.param_gatherer is not None:  # the step's backward is over: free whatever is gathered
                self.param_gatherer.release_all()
            return
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
            p.grad = p.main_grad if not self.shard_grads and p.dtype == self.grad_data.dtype else None

    # ---- parameter all-gather (distributed optimizer) -----------------------------------------
    def start_param_gather(self) -> list:
        """All-gather every bucket's updated shards into the parameter buffer (async handles)."""
        works = []
        if not self.distributed or self.shard_params:  # ZeRO-3 gathers before each use instead
            return works
        for b in self.buckets:
            lo, hi = self.shard_range(b)
            shard = self.param_data[lo:hi].clone()
            out = self.param_data[b.start:b.end]
            works.append(self.pg.all_gather_flat(out, shard, self.kind, async_op=True, label="param_all_gather"))
        return works


_PLACEHOLDERS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What a sharded (ZeRO-3) parameter holds while not gathered: one NaN expanded to its shape, so the
    shape stays readable, no memory is held, and a use by mistake poisons the result visibly."""
    key = (dtype, torch.device(device))
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.full((1,), float("nan"), dtype=dtype, device=device)
    return _PLACEHOLDERS[key].expand(shape)


class _Done:
    """A finished work handle (a one-rank intra-node step has nothing to wait for)."""

    def wait(self) -> bool:
        return True
