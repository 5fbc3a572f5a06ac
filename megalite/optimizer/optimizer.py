"""The training optimizer: fp32 main params, loss-scale handling, the true global grad norm, clipping,
AdamW, and the distributed (sharded) variant — one class, since sharding only changes which slice of
each parameter this rank updates.

For each parameter, this rank owns a flat slice (all of it, or with --use-distributed-optimizer / a
--data-parallel-sharding-strategy its part of the DP shard of the gradient buffer). The fp32 main copy
of that slice (an alias of the model weight for fp32 models without offload), its gradient view and its
Adam moments are all this rank keeps.
Bytes per parameter (mixed precision): 2 + 4 + 12 = 18, or 2 + 4 + 12/d when sharded.

Adam's parameter groups hold these slices, so a shard that spans an embedding and a layer simply has
slices in two groups (--decoupled-lr gives the embedding and output layer groups of their own).

With --optimizer-cpu-offload the leading --optimizer-offload-fraction of the owned slices keep their main
params and moments in a host pool (optimizer/offload.py) and are updated by a second, host AdamW; the
rest stays on the device. Same update, same global norm (summed in entry order either way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megalite import compat, device
from megalite.config.arguments import MegaliteConfig
from megalite.config.training import OptimizerConfig
from megalite.distributed.grad_buffer import GradBuffer
from megalite.optimizer.adam import build_adamw
from megalite.optimizer.clip import counted_ranges
from megalite.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler
from megalite.optimizer.offload import HostPool, offloaded_count
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.param_meta import DENSE, ParamFamily, model_families, param_meta


@dataclass
class Entry:
    param: nn.Parameter
    lo: int
    hi: int
    main: torch.Tensor  # fp32 slice being optimized
    alias: bool  # main is the model weight itself
    counted: list[tuple[int, int]]  # ranges of [0, hi - lo) that count in the grad norm
    weight: torch.Tensor  # the model weights of the slice (a view; in the shard storage with ZeRO-3)
    grad: torch.Tensor  # its reduced gradient (a view into the gradient buffer, or shard with ZeRO-2/3)
    host: dict[str, torch.Tensor] | None = None  # offloaded: this slice's rows of the host pool
    family: ParamFamily = DENSE  # the groups its partial sums are reduced over


@dataclass
class SliceState:
    """The optimizer state of the flat slice [lo, hi) of ``param`` this rank owns; ``tensors`` holds
    "main" (fp32 params), "exp_avg" and "exp_avg_sq" (Adam moments), hi - lo elements each."""

    param: nn.Parameter
    lo: int
    hi: int
    tensors: dict[str, torch.Tensor]


@dataclass
class StepResult:
    skipped: bool
    grad_norm: float | None


def make_loss_scaler(cfg: MegaliteConfig):
    pr = cfg.precision
    if not pr.fp16:
        return None
    if pr.loss_scale is not None:
        return ConstantLossScaler(pr.loss_scale)
    return DynamicLossScaler(pr.initial_loss_scale, pr.min_loss_scale, pr.loss_scale_window, pr.hysteresis,
                             pr.loss_scale_collapse_iters)


def param_groups(slices: list[tuple[nn.Parameter, torch.Tensor]], o: OptimizerConfig) -> list[dict]:
    """Adam's groups of the (parameter, main slice) pairs, as Megatron forms them: weight decay on matrices
    only (not on biases and norm weights); with --decoupled-lr, the input embedding's and the output layer's
    slices in groups of their own, marked ``is_decoupled_lr`` (the rate step() sets differs)."""
    groups = {(False, True): [], (False, False): []}  # (decoupled, decayed) -> main slices; these two always
    for p, main in slices:
        decoupled = o.decoupled_lr is not None and param_meta(p).embedding_or_output
        groups.setdefault((decoupled, p.ndim > 1), []).append(main)
    return [{"params": mains, "weight_decay": o.weight_decay if decayed else 0.0, "is_decoupled_lr": decoupled}
            for (decoupled, decayed), mains in groups.items()]


class MegaliteOptimizer:
    def __init__(self, buffers: list[GradBuffer], cfg: MegaliteConfig, pg: ProcessGroups) -> None:
        self.buffers, self.pg, self.cfg = buffers, pg, cfg
        self.distributed = cfg.ddp.shards_optimizer and pg.grad_size > 1
        # the same on every rank (each family's reductions are collective), with its reduction groups
        self.families = {f: f.reduced_over(pg, cfg.ddp.shards_optimizer and pg.size(f.dp_kind(pg)) > 1)
                         for f in model_families(cfg.model.is_moe)}
        self.scaler = make_loss_scaler(cfg)
        regions = [(buf, p, *buf.owned_region(p)) for buf in buffers for p in buf.ranges if buf.owned_region(p)]
        n_host = offloaded_count([hi - lo for _, _, lo, hi in regions], cfg.ddp.optimizer_offload_fraction) \
            if cfg.ddp.optimizer_cpu_offload else 0
        self.pool = HostPool(sum(hi - lo for _, _, lo, hi in regions[:n_host]))
        self.copies = device.SideStream() if n_host else None
        self.entries: list[Entry] = []
        for i, (buf, p, lo, hi) in enumerate(regions):
            flat = buf.param_slice(p, lo, hi)
            host = self.pool.take(hi - lo) if i < n_host else None
            alias = host is None and p.dtype == torch.float32
            if host is not None:
                main = host["main"].copy_(flat)
            else:
                main = flat if alias else flat.detach().to(torch.float32, copy=True)
            self.entries.append(Entry(p, lo, hi, main, alias, counted_ranges(p, pg, lo, hi), flat,
                                      buf.grad_slice(p, lo, hi), host, param_meta(p).family))
        self.adam = self._build([e for e in self.entries if e.host is None], on_gpu=device.has_cuda())
        self.host_adam = self._build([e for e in self.entries if e.host is not None], on_gpu=False)
        self._reset_host_state(0.0)
        self.pending_gathers: list = []

    def _build(self, entries: list[Entry], on_gpu: bool) -> torch.optim.Optimizer | None:
        if not entries:
            return None
        o = self.cfg.optimizer
        groups = param_groups([(e.param, e.main) for e in entries], o)
        return build_adamw(groups, on_gpu=on_gpu, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)

    def _reset_host_state(self, step: float) -> None:
        """The host AdamW's state is the pool's moment rows (not tensors AdamW would allocate itself)."""
        for e in self.entries:
            if e.host is not None:
                self.host_adam.state[e.main] = {"step": torch.tensor(step, dtype=torch.float32),
                                                "exp_avg": e.host["exp_avg"], "exp_avg_sq": e.host["exp_avg_sq"]}

    def _adam_of(self, e: Entry) -> torch.optim.Optimizer:
        return self.host_adam if e.host is not None else self.adam

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def zero_grad(self) -> None:
        for b in self.buffers:
            b.zero_grad()

    def _combine(self, local: dict[ParamFamily, torch.Tensor], op=dist.ReduceOp.SUM) -> torch.Tensor:
        """The global value of per-entry quantities kept apart per parameter family: each family's partial
        reduced over its groups (e.g. dense: TP x PP, and DP when each DP rank holds a different shard),
        then the families summed (or maxed) in their order."""
        total = None
        for family, groups in self.families.items():
            t = local[family]
            for kind in groups:
                self.pg.all_reduce(t, kind, op=op)
            total = t if total is None else (total + t if op == dist.ReduceOp.SUM else torch.maximum(total, t))
        return total

    def _grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every owned slice's fp32 gradient, set as its main param's ``.grad``: (device slices, offloaded
        ones). Offloaded gradients are copied into the host pool on the side stream while the device
        converts its own; the host waits for the copies before it reads them."""
        dev, host = [], []
        if self.copies is not None:
            self.copies.wait_for_default()  # the gradients are final on the default stream
            with self.copies.use():
                for e in self.entries:
                    if e.host is not None:
                        g = e.grad
                        e.host["grad"].copy_(g if g.dtype == torch.float32 else g.float(), non_blocking=True)
                        e.main.grad = e.host["grad"]
                        host.append(e.main.grad)
        for e in self.entries:
            if e.host is None:
                g = e.grad
                e.main.grad = g if g.dtype == torch.float32 and g.device == e.main.device else \
                    g.to(e.main.device, torch.float32)
                dev.append(e.main.grad)
        if self.copies is not None:
            self.copies.synchronize()
        return dev, host

    def _found_inf(self) -> bool:
        found = {f: torch.zeros(1, device=device.current_device()) for f in self.families}
        for e in self.entries:
            found[e.family] = torch.maximum(found[e.family], (~torch.isfinite(e.main.grad)).any().float().reshape(1)
                                            .to(found[e.family].device))
        return bool(self._combine(found, dist.ReduceOp.MAX).item())

    def _grad_norm(self) -> float:
        """The true global norm: each counted element once, summed in entry order (offloaded or not)."""
        where = self.entries[0].main.device if self.entries else None
        sq = {f: torch.zeros(1, dtype=torch.float32, device=where) for f in self.families}
        for e in self.entries:
            for s, t in e.counted:
                sq[e.family] += e.main.grad[s:t].square().sum().to(sq[e.family].device)
        return float(self._combine({k: v.to(device.current_device()) for k, v in sq.items()}).sqrt())

    @torch.no_grad()
    def step(self, lr: float, clip_grad: float, decoupled_lr: float | None = None) -> StepResult:
        """One update at rate ``lr`` (``decoupled_lr`` for the --decoupled-lr groups) after unscaling,
        the overflow check and clipping to ``clip_grad``."""
        lists = [g for g in self._grads() if g]
        if self.scaler is not None:
            for grads in lists:
                compat.scale_(grads, 1.0 / self.scaler.scale)
            found_inf = self._found_inf()
            self.scaler.update(found_inf)
            if found_inf:
                return StepResult(True, None)
        norm = self._grad_norm()
        if clip_grad > 0 and norm > clip_grad and norm == norm:
            for grads in lists:
                compat.scale_(grads, clip_grad / (norm + 1e-6))
        self._update(lr, decoupled_lr)
        for b in self.buffers:
            self.pending_gathers += b.start_param_gather()
        if not self.cfg.ddp.overlap_param_gather:
            self.wait_param_gather()
        return StepResult(False, norm)

    def _update(self, lr: float, decoupled_lr: float | None) -> None:
        """AdamW: the device part first (asynchronous kernels on a GPU), then the host part while it runs;
        the updated host slices go back to the weights on the side stream, which the default stream then
        waits for (the parameter all-gather and the next forward read them)."""
        for adam in (self.adam, self.host_adam):
            for group in adam.param_groups if adam is not None else []:
                group["lr"] = decoupled_lr if group["is_decoupled_lr"] and decoupled_lr is not None else lr
        if self.adam is not None:
            self.adam.step()
        if self.host_adam is not None:
            self.host_adam.step()
        for e in self.entries:
            if e.host is None and not e.alias:
                e.weight.copy_(e.main)
            e.main.grad = None
        if self.copies is not None:
            with self.copies.use():
                for e in self.entries:
                    if e.host is not None:
                        dst = e.weight
                        dst.copy_(e.main.to(dst.device, non_blocking=True))
            self.copies.default_waits()

    def state_tensors(self) -> tuple[list[SliceState], float]:
        """What a checkpoint stores: every owned slice's main params and Adam moments (the live tensors,
        not copies; before the first step, zeros that take no memory) and Adam's step count."""
        slices, step = [], 0.0
        for e in self.entries:
            state = self._adam_of(e).state.get(e.main, {})
            zeros = e.main.new_zeros(()).expand_as(e.main)
            tensors = {"main": e.main, **{f: state.get(f, zeros) for f in ("exp_avg", "exp_avg_sq")}}
            step = max(step, float(state.get("step", step)))
            slices.append(SliceState(e.param, e.lo, e.hi, tensors))
        return slices, step

    @torch.no_grad()
    def load_state_tensors(self, values: list[dict[str, torch.Tensor]], step: float) -> None:
        """Restore the state ``state_tensors`` describes: ``values[i]`` are the "main", "exp_avg" and
        "exp_avg_sq" tensors of its i-th slice (flat, hi - lo elements). The model weights take the
        loaded main params (offloaded ones into the host pool); step 0 (never stepped) leaves Adam
        without state, as a fresh run."""
        if len(values) != len(self.entries):
            raise ValueError(f"optimizer state for {len(values)} slices, this rank owns {len(self.entries)}")
        for e, v in zip(self.entries, values):
            e.main.copy_(v["main"])
            if not e.alias:  # the weight is the low-precision (or device) copy of the fp32 main param
                e.weight.copy_(e.main)
            if e.host is not None:
                for f in ("exp_avg", "exp_avg_sq"):
                    e.host[f].copy_(v[f])
                continue
            state = self.adam.state[e.main]
            state["step"] = torch.tensor(step, dtype=torch.float32, device=e.main.device)  # fused: on device
            state["exp_avg"] = v["exp_avg"].to(e.main.device).clone()
            state["exp_avg_sq"] = v["exp_avg_sq"].to(e.main.device).clone()
        self._reset_host_state(step)
        if step == 0 and self.adam is not None:
            self.adam.state.clear()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes the optimizer holds beyond the model: its host pool (16 per offloaded element), and on the
        device its fp32 main copies (none where they alias fp32 weights) and Adam moments."""
        on_device = 0
        for e in self.entries:
            if e.host is None:
                state = self.adam.state.get(e.main, {})
                on_device += (0 if e.alias else e.main.nbytes) + sum(
                    state[f].nbytes for f in ("exp_avg", "exp_avg_sq") if f in state)
        return {"host_pool": self.pool.nbytes, "device": on_device, "host_elements": self.pool.numel,
                "elements": sum(e.hi - e.lo for e in self.entries)}

    def wait_param_gather(self) -> None:
        """Finish the all-gather of updated parameters that step() left running (--overlap-param-gather).
        Whoever reads the parameters next calls it: the training step before its forward, evaluation, a
        save. The model knows nothing of it."""
        for w in self.pending_gathers:
            w.wait()
        self.pending_gathers = []
