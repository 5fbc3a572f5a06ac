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

import pytest
import torch

from megalite import compat, device
from megalite.attention import Documents, core_attention
from megalite.attention import core as attention_core
from megalite.config.model import ModelConfig
from megalite.model.norm import Norm
from megalite.moe.experts import grouped_linear
from megalite.optimizer.adam import build_adamw
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.random import RNGTracker
from tests.gpu_targets import (
    FP16,
    FP32,
    LOW,
    OP_FP32,
    assert_close,
    assert_curve,
    config,
    cpu_reference,
    leaf,
    on,
    run,
    targets,
    train,
)


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


def _packed_pass(target: str, backend: str, dtype: torch.dtype, varlen: bool, monkeypatch) -> dict:
    """core_attention inside packed documents (GQA), forward and backward; fp32 results on the host."""
    monkeypatch.setattr(attention_core, "VARLEN", varlen)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 8, 32, 16, generator=g)
    k, v = (torch.randn(2, 2, 32, 16, generator=g) for _ in range(2))
    dout = torch.randn(q.shape, generator=g)
    docs = Documents.from_cu_seqlens(torch.tensor([0, 7, 23, 24, 32, 64]), 2, 32)
    with on(target) as dev:
        q, k, v = (leaf(t, dev, dtype) for t in (q, k, v))
        out = core_attention(q, k, v, 0.0, backend, docs)
        out.backward(dout.to(dev, dtype))
        return {"out": out.float(), "dq": q.grad.float(), "dk": k.grad.float(), "dv": v.grad.float()}


@targets("packed documents: CUDA's variable-length flash kernel (attention/varlen.py) and the per-document calls")
@pytest.mark.parametrize("backend,dtype,varlen", [("auto", torch.bfloat16, True), ("flash", torch.bfloat16, True),
                                                  ("auto", torch.bfloat16, False), ("fused", torch.float32, False)],
                         ids=["varlen-auto-bf16", "varlen-flash-bf16", "per-document-bf16", "per-document-fp32"])
def test_packed_attention_matches_the_cpu(target, backend, dtype, varlen, monkeypatch):
    want = _packed_pass("cpu", "unfused", torch.float32, False, monkeypatch)
    got = _packed_pass(target, backend, dtype, varlen, monkeypatch)
    assert_close(got, want, OP_FP32 if dtype == torch.float32 else LOW, f"packed {backend} {dtype} varlen={varlen}")


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


@targets("device.HostSnapshot: --async-save's host copies on a side stream, unaffected by the next step's writes")
def test_host_snapshot_keeps_the_values_of_its_moment(target):
    with on(target) as dev:
        snap = device.HostSnapshot()
        for round_ in range(2):  # the second snapshot reuses the first one's pinned buffers
            w = torch.arange(8192.0, device=dev) * (round_ + 1)
            w.mul_(3)  # default-stream work the copy must wait for
            host = snap.copy({"w": w})["w"]
            w.add_(1000)  # the next optimizer step, writing the parameter while the copy may still run
            snap.ready()
            assert host.device.type == "cpu" and host.is_pinned() == (target == "cuda")
            assert torch.equal(host, torch.arange(8192.0) * 3 * (round_ + 1))


@targets("--async-save (checkpointing/async_save.py through device.HostSnapshot): the files equal a sync save's")
def test_async_save_writes_the_bytes_of_a_sync_save(target, tmp_path):
    import filecmp
    import time

    from megalite.checkpointing import async_save
    from megalite.checkpointing.paths import iter_dirname
    from tests.test_async_save import _files, _train

    with on(target):
        sync = _train(0, 1, save=str(tmp_path / "sync"), save_interval=2).losses
        async_save.FAULT = lambda point: time.sleep(0.05)  # a writer that spans the next steps
        try:
            res = _train(0, 1, save=str(tmp_path / "async"), save_interval=2, async_save=True)
        finally:
            async_save.FAULT = None
    assert res.losses == sync
    for it in (2, 4, 6):
        a, s = (str(tmp_path / kind / iter_dirname(it)) for kind in ("async", "sync"))
        assert _files(a) == _files(s) and _files(s)
        _, mismatch, errors = filecmp.cmpfiles(a, s, _files(s), shallow=False)
        assert not mismatch and not errors, (it, mismatch, errors)


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
