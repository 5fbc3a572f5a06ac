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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megalite import device
from megalite.config.arguments import MegaliteConfig
from megalite.config.training import OptimizerConfig
from megalite.distributed.grad_buffer import GradBuffer
from megalite.optimizer.adam import build_adamw
from megalite.optimizer.clip import counted_ranges
from megalite.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler
from megalite.parallel.groups import Group, ProcessGroups
from megalite.tensor_parallel.param_meta import param_meta


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
        o = cfg.optimizer
        self.buffers, self.pg, self.cfg = buffers, pg, cfg
        self.distributed = cfg.ddp.shards_optimizer and pg.grad_size > 1
        self.scaler = make_loss_scaler(cfg)
        offload = cfg.ddp.optimizer_cpu_offload and device.has_cuda()
        self.entries: list[Entry] = []
        for buf in buffers:
            for p in buf.ranges:
                region = buf.owned_region(p)
                if region is None:
                    continue
                lo, hi = region
                flat = buf.param_slice(p, lo, hi)
                alias = p.dtype == torch.float32 and not offload
                main = flat if alias else flat.detach().to(torch.float32, copy=True)
                if offload:
                    main = main.cpu().pin_memory() if device.has_cuda() else main.cpu()
                self.entries.append(Entry(p, lo, hi, main, alias, counted_ranges(p, pg, lo, hi), flat,
                                          buf.grad_slice(p, lo, hi)))
        groups = param_groups([(e.param, e.main) for e in self.entries], o)
        self.adam = build_adamw(groups, on_gpu=device.has_cuda() and not offload, lr=o.lr,
                                betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
        self.pending_gathers: list = []

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def zero_grad(self) -> None:
        for b in self.buffers:
            b.zero_grad()

    def _reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Over the model-parallel group, and over DP too when each DP rank holds a different shard."""
        self.pg.all_reduce(t, Group.MP, op=op)
        if self.distributed:
            self.pg.all_reduce(t, self.pg.grad_kind, op=op)
        return t

    @torch.no_grad()
    def step(self, lr: float, clip_grad: float, decoupled_lr: float | None = None) -> StepResult:
        """One update at rate ``lr`` (``decoupled_lr`` for the --decoupled-lr groups) after unscaling,
        the overflow check and clipping to ``clip_grad``."""
        grads = []
        for e in self.entries:
            g = e.grad
            if g.dtype != torch.float32 or g.device != e.main.device:
                g = g.to(e.main.device, torch.float32)
            e.main.grad = g
            grads.append(g)
        dev = self.entries[0].main.device if self.entries else device.current_device()
        if self.scaler is not None:
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
            found = torch.zeros(1, device=dev)
            for g in grads:
                found = torch.maximum(found, (~torch.isfinite(g)).any().float().reshape(1))
            found_inf = bool(self._reduce(found.to(device.current_device()), dist.ReduceOp.MAX).item())
            self.scaler.update(found_inf)
            if found_inf:
                return StepResult(True, None)
        sq = torch.zeros(1, dtype=torch.float32, device=dev)
        for e, g in zip(self.entries, grads):
            for s, t in e.counted:
                sq += g[s:t].square().sum()
        norm = float(self._reduce(sq.to(device.current_device())).sqrt())
        if clip_grad > 0 and norm > clip_grad and norm == norm:
            torch._foreach_mul_(grads, clip_grad / (norm + 1e-6))
        for group in self.adam.param_groups:
            group["lr"] = decoupled_lr if group["is_decoupled_lr"] and decoupled_lr is not None else lr
        self.adam.step()
        for e in self.entries:
            if not e.alias:
                e.weight.copy_(e.main)
            e.main.grad = None
        for b in self.buffers:
            self.pending_gathers += b.start_param_gather()
        if not self.cfg.ddp.overlap_param_gather:
            self.wait_param_gather()
        return StepResult(False, norm)

    def state_tensors(self) -> tuple[list[SliceState], float]:
        """What a checkpoint stores: every owned slice's main params and Adam moments (the live tensors,
        not copies; before the first step, zeros that take no memory) and Adam's step count."""
        slices, step = [], 0.0
        for e in self.entries:
            state = self.adam.state.get(e.main, {})
            zeros = e.main.new_zeros(()).expand_as(e.main)
            tensors = {"main": e.main, **{f: state.get(f, zeros) for f in ("exp_avg", "exp_avg_sq")}}
            step = float(state.get("step", step))
            slices.append(SliceState(e.param, e.lo, e.hi, tensors))
        return slices, step

    @torch.no_grad()
    def load_state_tensors(self, values: list[dict[str, torch.Tensor]], step: float) -> None:
        """Restore the state ``state_tensors`` describes: ``values[i]`` are the "main", "exp_avg" and
        "exp_avg_sq" tensors of its i-th slice (flat, hi - lo elements). The model weights take the
        loaded main params; step 0 (never stepped) leaves Adam without state, as a fresh run."""
        if len(values) != len(self.entries):
            raise ValueError(f"optimizer state for {len(values)} slices, this rank owns {len(self.entries)}")
        for e, v in zip(self.entries, values):
            e.main.copy_(v["main"])
            if not e.alias:  # the weight is the low-precision copy of the fp32 main param
                e.weight.copy_(e.main)
            state = self.adam.state[e.main]
            state["step"] = torch.tensor(step, dtype=torch.float32, device=e.main.device)  # fused: on device
            state["exp_avg"] = v["exp_avg"].to(e.main.device).clone()
            state["exp_avg_sq"] = v["exp_avg_sq"].to(e.main.device).clone()
        if step == 0:
            self.adam.state.clear()

    def wait_param_gather(self) -> None:
        """Finish the all-gather of updated parameters that step() left running (--overlap-param-gather).
        Whoever reads the parameters next calls it: the training step before its forward, evaluation, a
        save. The model knows nothing of it."""
        for w in self.pending_gathers:
            w.wait()
        self.pending_gathers = []
