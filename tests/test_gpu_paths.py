"""Promise: every CUDA-only branch of megalite computes what the CPU computes (bench/README.md, "GPU paths").

Each test runs for two targets:
- ``cuda``: skipped without a GPU, the reason naming the path; megalite runs on the GPU and its result is
  compared with a CPU run of the same seed and inputs;
- ``cpu-vs-cpu``: the same test code with MEGALITE_FORCE_CPU=1 on both sides, so the comparison code itself
  is proven on every machine and a first GPU run can fail only on a real difference.

Tolerances against the CPU: fp32 1e-4 relative (loss curves, grad norms) and 1e-5 (single ops, norm-relative);
bf16 and fp16 2e-2 against the CPU's fp32 result (fp16 with loss scaling against the CPU's fp16 run, whose
loss-scale trajectory must be the same).

Paths: the device layer (synchronisation, RNG state, empty_cache, memory statistics, name, peak FLOP/s); apex
absent, so torch's fused AdamW and torch's norms run; fused AdamW against the CPU's foreach update; SDPA's
flash and memory-efficient kernels (--attention-backend flash|fused); fp32, bf16 and fp16 (dynamic loss
scaling) training; the distributed optimizer; --optimizer-cpu-offload (pinned host pool, side-stream copies);
grouped GEMM in bf16 (--moe-grouped-gemm); the CP ring's blocks and their dropout replayed from the device
generator; activation recomputation and checkpoint resume replaying the device generator; the profiler's
CUDA activity; NCCL initialisation (one rank) with --distributed-timeout-minutes; several ranks on one GPU over
gloo with CUDA tensors (TP 2, DP 2 with the distributed optimizer, CP 2 all-gather and all-to-all, EP 2), after
a probe of the collectives gloo runs on CUDA tensors; pretrain_gpt.py on the device.

Out of reach of one GPU (bench/README.md, "GPU paths", says why): NCCL with several ranks; point-to-point
messages over gloo with CUDA tensors (pipeline stages, the CP ring's exchanges); apex's kernels.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from megalite import compat, device
from megalite.config import validate
from megalite.config.arguments import MegaliteConfig
from megalite.config.model import ModelConfig
from megalite.context_parallel import blockwise, ring
from megalite.context_parallel.attention import context_parallel_attention
from megalite.launch import rendezvous
from megalite.launch.run import run_timeout
from megalite.model.norm import Norm
from megalite.model.transformer import core_attention
from megalite.moe.experts import grouped_linear
from megalite.optimizer.adam import build_adamw
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.random import RNGTracker
from megalite.training.loop import TrainResult, pretrain
from tests.asserts import assert_rel_close
from tests.cli_utils import losses, run_pretrain
from tests.harness import free_port, run_ranks
from tests.tp_utils import GPT2, LLAMA_GQA, mock_data

HAS_CUDA = torch.cuda.is_available()
FORCE_CPU = "MEGALITE_FORCE_CPU"
VOCAB, ITERS, SAMPLES = 256, 6, 64
FP32, OP_FP32, LOW = 1e-4, 1e-5, 2e-2  # fp32 curves; fp32 single ops; bf16/fp16 against fp32
MODELS = {"gpt2": GPT2, "llama": LLAMA_GQA,
          "moe": {**GPT2, "num_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01,
                  "disable_bias_linear": True}}
BASE = dict(micro_batch_size=2, global_batch_size=4, train_iters=ITERS, lr=3e-3, lr_warmup_iters=2, log_interval=1,
            eval_iters=0, eval_interval=1000, mock_data=True, vocab_size=VOCAB, seed=1234, clip_grad=1.0)
DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
FP16 = {"fp16": True, "initial_loss_scale": 2.0**20, "loss_scale_window": 2, "hysteresis": 1}


def targets(path: str) -> pytest.MarkDecorator:
    """Run the test on the GPU (skipped without one, the reason naming ``path``) and as CPU against CPU."""
    return pytest.mark.parametrize("target", [
        pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason=f"needs CUDA: {path}"), id="cuda"),
        pytest.param("cpu", id="cpu-vs-cpu")])


@contextlib.contextmanager
def on(target: str) -> Iterator[torch.device]:
    """megalite's device layer reports ``target`` inside (MEGALITE_FORCE_CPU decides); yields its device."""
    old = os.environ.get(FORCE_CPU)
    os.environ[FORCE_CPU] = "0" if target == "cuda" else "1"
    try:
        assert device.device_type() == target, f"megalite chose {device.device_type()} for target {target}"
        yield device.current_device()
    finally:
        if old is None:
            os.environ.pop(FORCE_CPU, None)
        else:
            os.environ[FORCE_CPU] = old


# ---- comparisons -------------------------------------------------------------------------------------
def leaf(t: torch.Tensor, dev: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh leaf copy on ``dev``: ``.to`` returns the tensor itself where nothing changes (CPU to CPU),
    and two runs would then share it and its ``.grad``."""
    return t.to(dev, dtype or t.dtype, copy=True).requires_grad_()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64 on the host: elementwise ratios explode where values cross zero."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert a.shape == b.shape, f"shapes differ: {list(a.shape)} vs {list(b.shape)}"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float, what: str) -> None:
    """Every tensor of ``want`` is matched by ``got``'s within ``rtol`` (norm-relative); names the ones that are not."""
    assert set(got) == set(want), f"{what}: {sorted(got)} vs {sorted(want)}"
    errs = {k: rel_err(got[k], want[k]) for k in want}
    bad = {k: f"{e:.2e}" for k, e in errs.items() if not e <= rtol}
    assert not bad, f"{what}: relative error above {rtol:g}: {bad} (all: { {k: f'{e:.1e}' for k, e in errs.items()} })"


@dataclass(frozen=True)
class Curve:
    """What a short training run logged, per iteration."""

    losses: tuple[float, ...]
    grad_norms: tuple[float | None, ...]
    loss_scales: tuple[float, ...]
    skipped: int
    log: tuple[str, ...] = ()


def assert_curve(got: Curve, want: Curve, rtol: float, what: str, norms: bool = True) -> None:
    """Loss (and grad norm) of every iteration within ``rtol``; ``norms=False`` where bf16 moves the grad norms
    more than the losses (MoE routing, attention kernels)."""
    assert_rel_close(got.losses, want.losses, rtol, f"{what}: lm loss")
    if norms:
        assert_rel_close(got.grad_norms, want.grad_norms, rtol, f"{what}: grad norm")


# ---- training runs -----------------------------------------------------------------------------------
def config(model: str, **flags) -> MegaliteConfig:
    """A tiny mock-data run of ``model`` (6 iterations, global batch 4, seed 1234) with ``flags`` on top."""
    return MegaliteConfig.from_flat({**MODELS[model], **BASE, **flags})


def groups(cfg: MegaliteConfig, world: int, rank: int) -> ProcessGroups:
    """This rank's groups of ``cfg``'s layout over the initialized world (none for one rank)."""
    p = cfg.parallel
    if world == 1:
        return ProcessGroups.single()
    layout = RankLayout(world, p.tensor_model_parallel_size, 1, p.context_parallel_size,
                        ep=p.expert_model_parallel_size)
    return ProcessGroups.build(layout, rank)


def run(cfg: MegaliteConfig, world: int = 1, rank: int = 0) -> tuple[Curve, TrainResult]:
    """Train ``cfg`` in this process on whatever device megalite picks; the curve and the full result."""
    validate(cfg, world)
    lines: list[str] = []
    data = mock_data(VOCAB, cfg.model.seq_length, 1234, SAMPLES)
    res = pretrain(cfg, groups(cfg, world, rank), data=data, log=lines.append)
    return Curve(tuple(res.losses), tuple(res.grad_norms), tuple(res.loss_scales), res.skipped_iterations,
                 tuple(lines)), res


def train(target: str, model: str, **flags) -> Curve:
    """A run of ``model`` with ``flags`` on ``target`` (in this process)."""
    with on(target):
        return run(config(model, **flags))[0]


@functools.cache
def cpu_reference(model: str, flags: tuple[tuple[str, object], ...] = ()) -> Curve:
    """The CPU run (fp32 unless ``flags`` say otherwise) a device run is compared with; once per session."""
    return train("cpu", model, **dict(flags))


# ---- the device layer, apex, fused AdamW -------------------------------------------------------------
def _check_memory_stats(target: str, dev: torch.device) -> None:
    """The log line's memory fields: a 4 MiB tensor shows as 4 MB allocated on a GPU; the RSS peak on CPU."""
    before = device.memory_stats()
    x = torch.ones(1 << 20, device=dev)  # 4 MiB
    after = device.memory_stats()
    if target == "cpu":
        assert set(after) == {"max_rss_mb"} and after["max_rss_mb"] > 0
        return
    assert set(after) == {"allocated_mb", "max_allocated_mb", "reserved_mb"}
    assert after["allocated_mb"] - before["allocated_mb"] == pytest.approx(4.0), (before, after)
    assert after["max_allocated_mb"] >= after["allocated_mb"] and after["reserved_mb"] >= after["allocated_mb"]
    del x


@targets("the device layer (device.py: set_device, synchronize, RNG state, empty_cache, memory_stats, peak FLOP/s)")
def test_device_layer(target):
    with on(target) as dev:
        assert dev.type == target and device.backend() == ("nccl" if target == "cuda" else "gloo")
        assert device.set_device(0) == dev
        device.manual_seed(11)
        state = device.get_rng_state()
        drawn = torch.rand(8, device=dev)
        device.set_rng_state(state)
        assert torch.equal(drawn, torch.rand(8, device=dev)), "the device generator's state does not replay"
        device.synchronize()
        device.empty_cache()
        _check_memory_stats(target, dev)
        name, peak = device.device_name(), device.peak_tflops(torch.bfloat16)
        assert device.info()["device"] == name
    if target == "cpu":
        assert name == "cpu" and peak is None
    elif "H100" in name or "H200" in name:
        assert peak == 989.0, f"{name}: peak {peak}"


def _norm_pass(kind: str, dev: torch.device) -> dict[str, torch.Tensor]:
    """megalite's Norm forward and backward on ``dev`` (the path apex would replace), fixed inputs."""
    g = torch.Generator().manual_seed(5)
    x, dout = torch.randn(6, 3, 64, generator=g), torch.randn(6, 3, 64, generator=g)
    norm = Norm(ModelConfig(hidden_size=64, normalization=kind, norm_epsilon=1e-5),
                BuildContext(ProcessGroups.single(), RNGTracker(), device=dev))
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = leaf(x, dev)
    out = norm(x)
    out.backward(dout.to(dev))
    return {"out": out, "dx": x.grad, **{f"d{n}": p.grad for n, p in norm.named_parameters()}}


@targets("apex detection (device.py): apex absent, so torch's fused AdamW and torch's norms run")
def test_without_apex_torch_kernels_run(target):
    device.clear_apex_cache()
    assert device.apex_fused_adam_class() is None, "apex is importable: this machine is not the one described"
    with on(target) as dev:
        assert device.apex_fused_norm("LayerNorm", dev.type) is None
        assert device.apex_fused_norm("RMSNorm", dev.type) is None
        param = torch.zeros(4, device=dev, requires_grad=True)
        opt = build_adamw([{"params": [param], "weight_decay": 0.0}], on_gpu=device.has_cuda(), lr=1e-3,
                          betas=(0.9, 0.95), eps=1e-8)
        assert type(opt) is torch.optim.AdamW
        assert bool(opt.defaults.get("fused")) == (target == "cuda"), opt.defaults
        assert bool(opt.defaults.get("foreach")) == (target == "cpu"), opt.defaults
        for kind in ("LayerNorm", "RMSNorm"):
            assert_close(_norm_pass(kind, dev), _norm_pass(kind, torch.device("cpu")), OP_FP32, kind)


def _adam_updates(target: str) -> dict[str, torch.Tensor]:
    """Three AdamW steps (decayed matrix, undecayed bias) with fixed gradients: the updates and moments."""
    g = torch.Generator().manual_seed(9)
    init = {"w": torch.randn(32, 16, generator=g), "b": torch.randn(16, generator=g)}
    grads = [{k: torch.randn(v.shape, generator=g) * 10.0 ** -s for k, v in init.items()} for s in range(3)]
    with on(target) as dev:
        params = {k: leaf(v, dev) for k, v in init.items()}
        groups = [{"params": [params["w"]], "weight_decay": 0.1}, {"params": [params["b"]], "weight_decay": 0.0}]
        opt = build_adamw(groups, on_gpu=device.has_cuda(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
        for step in grads:
            for k, p in params.items():
                p.grad = step[k].to(dev, copy=True)
            opt.step()
        out = {f"update {k}": p.detach().cpu() - init[k] for k, p in params.items()}
        out |= {f"{m} {k}": opt.state[p][m] for k, p in params.items() for m in ("exp_avg", "exp_avg_sq")}
    return out


@targets("fused AdamW (optimizer/adam.py) against the CPU's foreach AdamW")
def test_fused_adamw_matches_the_cpu_update(target):
    assert_close(_adam_updates(target), _adam_updates("cpu"), OP_FP32, "AdamW")


# ---- attention kernels -------------------------------------------------------------------------------
def _attention_pass(target: str, backend: str, dtype: torch.dtype, gqa: bool) -> dict[str, torch.Tensor]:
    """core_attention (the model's SDPA call) forward and backward; fp32 results on the host."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 32, 16, generator=g)
    k, v = (torch.randn(2, 2 if gqa else 8, 32, 16, generator=g) for _ in range(2))
    dout = torch.randn(q.shape, generator=g)
    with on(target) as dev:
        q, k, v = (leaf(t, dev, dtype) for t in (q, k, v))
        out = core_attention(q, k, v, 0.0, backend)
        out.backward(dout.to(dev, dtype))
        return {"out": out.float(), "dq": q.grad.float(), "dk": k.grad.float(), "dv": v.grad.float()}


@targets("SDPA's flash and memory-efficient kernels (--attention-backend flash|fused, device.sdpa_kernels)")
@pytest.mark.parametrize("backend,dtype", [("flash", torch.bfloat16), ("fused", torch.float32),
                                           ("fused", torch.bfloat16)], ids=["flash-bf16", "fused-fp32", "fused-bf16"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_sdpa_kernel_matches_the_cpu_attention(target, backend, dtype, gqa):
    want = _attention_pass("cpu", "unfused", torch.float32, gqa)
    got = _attention_pass(target, backend, dtype, gqa)
    assert_close(got, want, OP_FP32 if dtype == torch.float32 else LOW, f"{backend} {dtype}")
    with on(target):
        refused = device.attention_backend_error("flash", torch.float32)
    assert (refused is not None) == (target == "cuda"), refused  # no flash kernel in fp32 on a GPU


# ---- training curves ---------------------------------------------------------------------------------
@targets("fp32 training on the device (fused AdamW, --empty-unused-memory-level) against the CPU curve")
@pytest.mark.parametrize("model,flags", [("gpt2", {}), ("llama", {}), ("gpt2", {"empty_unused_memory_level": 2})],
                         ids=["gpt2", "llama", "gpt2-empty-cache"])
def test_fp32_training_curve(target, model, flags):
    assert_curve(train(target, model, **flags), cpu_reference(model), FP32, f"{model} fp32 on {target}")


@targets("bf16 training (also with --use-distributed-optimizer) against the CPU fp32 curve")
@pytest.mark.parametrize("model,flags", [("gpt2", {}), ("llama", {}), ("gpt2", {"use_distributed_optimizer": True})],
                         ids=["gpt2", "llama", "gpt2-distributed-optimizer"])
def test_bf16_training_curve(target, model, flags):
    assert_curve(train(target, model, bf16=True, **flags), cpu_reference(model), LOW, f"{model} bf16 on {target}")


@targets("fp16 training with dynamic loss scaling (overflow skips, backoff, growth)")
def test_fp16_dynamic_loss_scaling(target):
    want = cpu_reference("gpt2", tuple(FP16.items()))
    steps = list(zip(want.loss_scales, want.loss_scales[1:]))
    assert want.skipped and any(b < a for a, b in steps) and any(b > a for a, b in steps), want  # back off, grow
    got = train(target, "gpt2", **FP16)
    assert (got.loss_scales, got.skipped) == (want.loss_scales, want.skipped), (got, want)
    assert_curve(got, want, LOW, f"fp16 on {target}")


@targets("--attention-backend flash (bf16) and fused (fp32) in training")
@pytest.mark.parametrize("model", ["gpt2", "llama"])
@pytest.mark.parametrize("backend", ["flash", "fused"])
def test_attention_backend_training_curve(target, model, backend):
    low = backend == "flash"
    got = train(target, model, attention_backend=backend, **({"bf16": True} if low else {}))
    assert_curve(got, cpu_reference(model), LOW if low else FP32, f"{model} {backend} on {target}", norms=not low)


# ---- optimizer offload: pinned pool, side stream -----------------------------------------------------
@targets("--optimizer-cpu-offload (optimizer/offload.py): the pinned host pool, side-stream copies, host AdamW")
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_optimizer_offload_curve(target, fraction):
    with on(target):
        curve, res = run(config("llama", optimizer_cpu_offload=True, optimizer_offload_fraction=fraction))
    opt = res.optimizer
    assert opt.pool.pinned == (target == "cuda") and (opt.copies.stream is not None) == (target == "cuda")
    host = [e for e in opt.entries if e.host is not None]
    kept = [e for e in opt.entries if e.host is None]
    assert host and all(e.main.device.type == "cpu" for e in host)
    assert bool(kept) == (fraction < 1) and all(e.main.device.type == target for e in kept)
    if kept:
        assert bool(opt.adam.defaults.get("fused")) == (target == "cuda")
    assert_curve(curve, cpu_reference("llama"), FP32, f"offload {fraction} on {target}")


@targets("device.SideStream and device.host_empty: asynchronous copies to and from pinned host memory")
def test_side_stream_copies(target):
    with on(target) as dev:
        host = device.host_empty(4096, torch.float32)
        assert host.device.type == "cpu" and host.is_pinned() == (target == "cuda")
        side = device.SideStream()
        assert (side.stream is not None) == (target == "cuda")
        x = torch.arange(4096.0, device=dev) * 3  # default-stream work the copy must wait for
        side.wait_for_default()
        with side.use():
            host.copy_(x, non_blocking=True)
        side.synchronize()
        assert torch.equal(host, torch.arange(4096.0) * 3)
        host.mul_(2)
        back = torch.empty(4096, device=dev)
        with side.use():
            back.copy_(host, non_blocking=True)
        side.default_waits()
        assert torch.equal((back + 0).cpu(), torch.arange(4096.0) * 6)


# ---- grouped GEMM, MoE -------------------------------------------------------------------------------
def _grouped_pass(target: str, dtype: torch.dtype, grouped: bool) -> tuple[dict[str, torch.Tensor], bool]:
    """grouped_linear forward and backward (4 experts, one without tokens); whether the grouped kernel ran."""
    counts = [5, 0, 9, 2]
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(16, 64, generator=g), torch.randn(4, 128, 64, generator=g) / 8
    dout = torch.randn(16, 128, generator=g)
    with on(target) as dev:
        x, w = leaf(x, dev, dtype), leaf(w, dev, dtype)
        y = grouped_linear(x, w, counts, grouped)
        y.backward(dout.to(dev, dtype))
        kernel = type(y.grad_fn).__name__ == "_ContiguousGradBackward"
        return {"out": y.float(), "dx": x.grad.float(), "dw": w.grad.float()}, kernel


@targets("grouped GEMM in bf16 (moe/experts.py grouped_linear through compat.grouped_mm)")
def test_grouped_gemm_bf16_matches_the_cpu_loop(target):
    supported = compat.grouped_mm_supported(target, torch.bfloat16)
    assert supported or target == "cpu", "this torch has no bf16 grouped GEMM on the GPU"
    want, _ = _grouped_pass("cpu", torch.float32, grouped=False)
    got, kernel = _grouped_pass(target, torch.bfloat16, grouped=True)
    assert kernel == supported
    assert_close(got, want, LOW, f"grouped GEMM bf16 on {target}")


@targets("MoE training with --moe-grouped-gemm in bf16 against the CPU's fp32 loop over experts")
def test_moe_grouped_gemm_training_curve(target):
    got = train(target, "moe", bf16=True, moe_grouped_gemm=True)
    assert_curve(got, cpu_reference("moe"), LOW, f"MoE grouped GEMM bf16 on {target}", norms=False)
    warned = any("--moe-grouped-gemm" in line for line in got.log)
    assert warned == (not compat.grouped_mm_supported(target, torch.bfloat16)), got.log[:3]


# ---- the CP ring's blocks ----------------------------------------------------------------------------
def _ring_inputs(documents: bool) -> dict[str, torch.Tensor | None]:
    """q (8 heads), k and v (2 groups) of 32 positions, the upstream gradient; two documents per row."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 8, 32, 16, generator=g)
    k, v = (torch.randn(2, 2, 32, 16, generator=g) for _ in range(2))
    seg = torch.tensor([[0] * 10 + [1] * 22, [0] * 20 + [1] * 12]) if documents else None
    return {"q": q, "k": k, "v": v, "dout": torch.randn(q.shape, generator=g), "segment_ids": seg}


def _attend(fn: Callable, inputs: dict, dev: torch.device) -> dict[str, torch.Tensor]:
    """fn(q, k, v, segment_ids) forward and backward on ``dev``: output and gradients on the host."""
    q, k, v = (leaf(inputs[n], dev) for n in "qkv")
    seg = inputs["segment_ids"]
    out = fn(q, k, v, None if seg is None else seg.to(dev))
    out.backward(inputs["dout"].to(dev))
    return {"out": out.cpu(), "dq": q.grad.cpu(), "dk": k.grad.cpu(), "dv": v.grad.cpu()}


def _ring(p: float) -> Callable:
    """The ring (--cp-comm-type p2p) on one CP rank: its blocks and merges, no exchange."""
    return lambda q, k, v, seg: context_parallel_attention(q, k, v, ProcessGroups.single(), "p2p", dropout_p=p,
                                                           segment_ids=seg)


@targets("the CP ring's blocks on the device (context_parallel/ring.py, blockwise.py), fp32")
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_ring_blocks_match_the_cpu(target, documents, monkeypatch):
    monkeypatch.setattr(ring, "ROW_TILE", 8)  # several row tiles per block
    inputs = _ring_inputs(documents)
    with on("cpu") as cpu:
        want = _attend(_ring(0.0), inputs, cpu)  # the CPU's blocks: its flash kernel
    monkeypatch.setattr(blockwise, "FUSED_CPU", False)  # on the CPU too, the plain blocks a GPU runs
    with on(target) as dev:
        got = _attend(_ring(0.0), inputs, dev)
    assert_close(got, want, OP_FP32, f"ring blocks on {target}")


def _explicit_dropout_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: None, p: float = 0.1
                                ) -> torch.Tensor:
    """softmax(QK^T) with the ring's dropout masks (drawn in its order: one per tile of 8 rows), then V."""
    b, nq, s, d = q.shape
    g = k.shape[1]
    keep = torch.cat([blockwise.dropout_mask((b, g, nq // g, 8, s), p, q.device) for _ in range(s // 8)], dim=3)
    k, v = (t.repeat_interleave(nq // g, dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * d ** -0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (scores.softmax(dim=-1) * keep.reshape(b, nq, s, s)) @ v


@targets("dropout in the CP ring's blocks, redrawn in backward from the device generator's saved state")
def test_ring_dropout_replays_the_device_generator(target, monkeypatch):
    monkeypatch.setattr(ring, "ROW_TILE", 8)
    inputs = _ring_inputs(False)
    with on(target) as dev:
        device.manual_seed(5)
        got = _attend(_ring(0.1), inputs, dev)
        device.manual_seed(5)
        want = _attend(_explicit_dropout_attention, inputs, dev)
    assert_close(got, want, OP_FP32, f"ring dropout on {target}")


# ---- the device generator in recomputation and resume; the profiler ----------------------------------
@targets("activation recomputation with dropout: the device generator replayed in the recompute")
def test_recompute_replays_device_dropout(target):
    plain = train(target, "gpt2", **DROPOUT)
    full = train(target, "gpt2", recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                 **DROPOUT)
    assert_curve(full, plain, FP32, f"full recompute on {target}")  # masks not replayed: 3e-3 loss, 5e-2 norm


@targets("checkpoint save and resume on the device: device tensors and the device generator's state")
def test_resume_continues_the_device_curve(target, tmp_path):
    straight = train(target, "gpt2", **DROPOUT)
    first = train(target, "gpt2", exit_interval=3, save=str(tmp_path), **DROPOUT)
    resumed = train(target, "gpt2", load=str(tmp_path), **DROPOUT)
    assert len(first.losses) == 3 and len(resumed.losses) == ITERS - 3
    assert_rel_close(first.losses + resumed.losses, straight.losses, FP32, f"resumed on {target}")


@targets("--profile with the CUDA activity (training/profiling.py): the trace holds the device's kernels")
def test_profiler_trace_has_device_kernels(target, tmp_path):
    train(target, "gpt2", train_iters=3, profile=True, profile_step_start=1, profile_step_end=2,
          profile_dir=str(tmp_path))
    events = json.loads((tmp_path / "trace_rank00000.json").read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert bool(kernels) == (target == "cuda"), f"{len(kernels)} kernel events of {len(events)}"


# ---- torch.distributed: NCCL with one rank; several ranks on one GPU over gloo -------------------------
def _check_collectives(dev: torch.device, group: dist.ProcessGroup | None = None) -> dict[str, str]:
    """Each collective megalite calls, on ``dev`` tensors over ``group``: 'ok' with the expected result, or
    the error's first line (an op the backend refuses raises on every rank alike, so the ranks stay in step)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    x = torch.arange(4.0, device=dev) + 10 * rank
    every = [torch.arange(4.0) + 10 * r for r in range(world)]
    checks: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {
        "all_reduce": lambda: (_done(dist.all_reduce(y := x.clone(), group=group), y), sum(every)),
        "all_reduce_max": lambda: (_done(dist.all_reduce(y := x.clone(), op=dist.ReduceOp.MAX, group=group), y),
                                   every[-1]),
        "broadcast": lambda: (_done(dist.broadcast(y := x.clone(), src=dist.get_global_rank(group, 0) if group
                                                   else 0, group=group), y), every[0]),
        "all_gather_into_tensor": lambda: (_done(compat.all_gather_into_tensor(
            y := torch.empty(4 * world, device=dev), x, group=group), y), torch.cat(every)),
        "reduce_scatter_tensor": lambda: (_done(compat.reduce_scatter_tensor(
            y := torch.empty(4 // world, device=dev), x, group=group), y), sum(every).chunk(world)[rank]),
        "all_to_all_single": lambda: (_done(dist.all_to_all_single(y := torch.empty(4, device=dev), x, group=group),
                                            y), torch.cat([e.chunk(world)[rank] for e in every])),
        "all_to_all_single_uneven": lambda: _uneven_all_to_all(x, every, rank, world, group),
    }
    out = {}
    for name, check in checks.items():
        try:
            got, want = check()
            out[name] = "ok" if torch.equal(got.cpu(), want) else f"wrong result {got.tolist()} != {want.tolist()}"
        except Exception as e:  # noqa: BLE001 - recorded: the test names the op and the error
            out[name] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    return out


def _done(work: dist.Work | None, tensor: torch.Tensor) -> torch.Tensor:
    """The synchronous collective's output (``work`` is None; a returned handle is waited on)."""
    if work is not None:
        work.wait()
    return tensor


def _uneven_all_to_all(x: torch.Tensor, every: list[torch.Tensor], rank: int, world: int,
                       group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank q sends rows of its 4 to rank r in splits that differ per sender (the MoE token dispatch)."""
    splits = [[1 + (q + r) % 3 if r < world - 1 else 0 for r in range(world)] for q in range(world)]
    for s in splits:
        s[-1] = 4 - sum(s)
    recv = [splits[q][rank] for q in range(world)]
    y = torch.empty(sum(recv), device=x.device)
    dist.all_to_all_single(y, x, recv, splits[rank], group=group)
    starts = [sum(splits[q][:rank]) for q in range(world)]
    return y, torch.cat([every[q][starts[q]:starts[q] + recv[q]] for q in range(world)])


def _timeout_of(dev: torch.device, group: dist.ProcessGroup | None = None) -> object:
    """The timeout the backend of ``group`` on ``dev`` was created with (what a hung collective waits)."""
    return (group or dist.group.WORLD)._get_backend(dev).options._timeout


def _world_of_one(rank: int, world: int, target: str) -> dict:
    """torch.distributed started as launch.init_distributed starts it (rendezvous store, megalite.device's
    backend, --distributed-timeout-minutes), with one rank; then every collective once, also on a subgroup."""
    os.environ[FORCE_CPU] = "0" if target == "cuda" else "1"
    dist.destroy_process_group()  # the harness's own gloo group
    os.environ["MASTER_PORT"] = str(free_port())
    timeout = run_timeout(config("gpt2", distributed_timeout_minutes=0.5))
    dev = device.set_device(0)
    rv = rendezvous.connect(0, 1, timeout)
    rendezvous.join(rv, 0, 1, timeout)
    dist.init_process_group(device.backend(), rank=0, world_size=1, timeout=timeout, store=rv.store)
    try:
        sub = dist.new_group([0], timeout=timeout)
        return {"backend": dist.get_backend(), "device": dev.type, "expected_timeout": timeout,
                "timeouts": (_timeout_of(dev), _timeout_of(dev, sub)), "world": _check_collectives(dev),
                "subgroup": _check_collectives(dev, sub)}
    finally:
        dist.destroy_process_group()


@targets("NCCL initialisation with one rank (launch/rendezvous.py, launch/run.py): backend, timeout, collectives")
def test_nccl_world_of_one(target):
    res = run_ranks(_world_of_one, 1, target, timeout=180)[0]
    assert res["backend"] == ("nccl" if target == "cuda" else "gloo") and res["device"] == target, res
    assert res["timeouts"] == (res["expected_timeout"],) * 2, res
    bad = {f"{where} {op}": r for where in ("world", "subgroup") for op, r in res[where].items() if r != "ok"}
    assert not bad, bad


# name: (model, flags at 2 ranks, the collectives the run needs)
GLOO_CASES = {
    "tp2": ("gpt2", {"tensor_model_parallel_size": 2}, ("all_reduce", "all_reduce_max")),
    "dp2_distributed_optimizer": ("gpt2", {"use_distributed_optimizer": True},
                                  ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")),
    "cp2_allgather": ("gpt2", {"context_parallel_size": 2, "cp_comm_type": "allgather"},
                      ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")),
    "cp2_a2a": ("gpt2", {"context_parallel_size": 2, "cp_comm_type": "a2a"}, ("all_reduce", "all_to_all_single")),
    "ep2_alltoall": ("moe", {"expert_model_parallel_size": 2, "moe_token_dispatcher_type": "alltoall"},
                     ("all_reduce", "all_gather_into_tensor", "all_to_all_single", "all_to_all_single_uneven")),
}
SERIAL_FLAGS = {"ep2_alltoall": (("moe_token_dispatcher_type", "alltoall"),)}


def _gloo_rank(rank: int, world: int, target: str) -> dict:
    """On one of ``world`` ranks over the harness's gloo: the probe of collectives on the ranks' device
    tensors, then each case whose collectives all passed (its curve, or the traceback)."""
    os.environ[FORCE_CPU] = "0" if target == "cuda" else "1"
    dev = device.set_device(rank)  # LOCAL_RANK modulo the devices: every rank on the one GPU
    probe = _check_collectives(dev)
    cases: dict[str, object] = {}
    for name, (model, flags, needs) in GLOO_CASES.items():
        missing = [op for op in needs if probe[op] != "ok"]
        if missing:
            cases[name] = "unsupported: " + ", ".join(missing)
            continue
        try:
            curve, res = run(config(model, **flags), world, rank)
            cases[name] = {"curve": curve, "device": next(res.chunks[0].parameters()).device.type}
        except Exception:  # noqa: BLE001 - the test shows it
            cases[name] = traceback.format_exc()
    return {"device": dev.type, "probe": probe, "cases": cases}


@functools.cache
def gloo_runs(target: str) -> list[dict]:
    """Both ranks' results of every case, once per session and target."""
    return run_ranks(_gloo_rank, 2, target, timeout=300)


@targets("gloo with CUDA tensors, 2 ranks on one GPU: the collectives megalite calls")
def test_gloo_collectives_on_device_tensors(target):
    for rank, res in enumerate(gloo_runs(target)):
        assert res["device"] == target
        bad = {op: r for op, r in res["probe"].items() if r != "ok"}
        assert not bad, f"rank {rank}: gloo on {target} tensors: {bad}"


@targets("2 ranks on one GPU over gloo with CUDA tensors: TP 2, DP 2 + distributed optimizer, CP 2, EP 2")
@pytest.mark.parametrize("case", list(GLOO_CASES))
def test_ranks_on_one_device_over_gloo(target, case):
    model = GLOO_CASES[case][0]
    want = cpu_reference(model, SERIAL_FLAGS.get(case, ()))
    for rank, res in enumerate(gloo_runs(target)):
        got = res["cases"][case]
        if isinstance(got, str) and got.startswith("unsupported"):
            pytest.skip(f"gloo on this torch cannot run {got.removeprefix('unsupported: ')} on {target} tensors")
        assert isinstance(got, dict), f"rank {rank}:\n{got}"
        assert got["device"] == target, f"rank {rank} trained on {got['device']}"
        assert_curve(got["curve"], want, FP32, f"{case} rank {rank} on {target}")


# ---- the command line ----------------------------------------------------------------------------------
CLI = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
       "--micro-batch-size 2 --global-batch-size 4 --train-iters 4 --lr 3e-3 --lr-warmup-iters 2 --log-interval 1 "
       "--eval-iters 0 --eval-interval 1000 --mock-data --vocab-size 256 --hidden-dropout 0 --attention-dropout 0 "
       "--seed 1234").split()


@functools.cache
def _cli(target: str) -> subprocess.CompletedProcess:
    """pretrain_gpt.py as users run it, megalite's device chosen by MEGALITE_FORCE_CPU; once per target."""
    return run_pretrain(CLI, env={FORCE_CPU: "0" if target == "cuda" else "1"}, timeout=240)


@targets("pretrain_gpt.py on the device: set_device, the log line's memory statistics, the loss curve")
def test_cli_run_on_the_device(target):
    got, want = losses(_cli(target)), losses(_cli("cpu"))
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for i in (0, 1):
        assert_rel_close([got[k][i] for k in sorted(got)], [want[k][i] for k in sorted(want)], FP32,
                         ("lm loss", "grad norm")[i])
    key = "allocated" if target == "cuda" else "max_rss"
    assert f"memory (MB): {key} " in _cli(target).stdout, _cli(target).stdout[-1500:]
