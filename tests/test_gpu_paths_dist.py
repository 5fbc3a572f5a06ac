"""The GPU-path promise of tests/test_gpu_paths.py (its docstring lists every path, both targets and the
tolerances), continued: the CP ring's blocks and their dropout, the device generator in recomputation and
resume, the profiler, torch.distributed (NCCL with one rank, several ranks on one GPU over gloo) and
pretrain_gpt.py on the device."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import traceback
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from megalite import compat, device
from megalite.attention import Documents, blocks
from megalite.context_parallel.attention import context_parallel_attention
from megalite.launch import rendezvous
from megalite.launch.run import run_timeout
from megalite.parallel.groups import ProcessGroups
from tests.asserts import assert_rel_close
from tests.cli_utils import losses, run_pretrain
from tests.gpu_targets import (
    DROPOUT,
    FORCE_CPU,
    FP32,
    ITERS,
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
from tests.harness import free_port, run_ranks


# ---- the CP ring's blocks ----------------------------------------------------------------------------
def _ring_inputs(documents: bool) -> dict[str, torch.Tensor | None]:
    """q (8 heads), k and v (2 groups) of 32 positions, the upstream gradient; two documents per row."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 8, 32, 16, generator=g)
    k, v = (torch.randn(2, 2, 32, 16, generator=g) for _ in range(2))
    docs = Documents.from_cu_seqlens(torch.tensor([0, 10, 32, 52, 64]), 2, 32) if documents else None
    return {"q": q, "k": k, "v": v, "dout": torch.randn(q.shape, generator=g), "documents": docs}


def _attend(fn: Callable, inputs: dict, dev: torch.device, dtype: torch.dtype = torch.float32
            ) -> dict[str, torch.Tensor]:
    """fn(q, k, v, documents) forward and backward on ``dev`` in ``dtype``: fp32 output and gradients on the host."""
    q, k, v = (leaf(inputs[n].to(dtype), dev) for n in "qkv")
    out = fn(q, k, v, inputs["documents"])
    out.backward(inputs["dout"].to(dev, dtype))
    return {n: t.detach().float().cpu() for n, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}


def _ring(p: float) -> Callable:
    """The ring (--cp-comm-type p2p) on one CP rank: its blocks and merges, no exchange."""
    return lambda q, k, v, docs: context_parallel_attention(q, k, v, ProcessGroups.single(), "p2p", dropout_p=p,
                                                            documents=docs)


@targets("the CP ring's blocks on the device (context_parallel/ring.py, attention/blocks.py), fp32")
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_ring_blocks_match_the_cpu(target, documents, monkeypatch):
    monkeypatch.setattr(blocks, "ROW_TILE", 8)  # several row tiles per block
    inputs = _ring_inputs(documents)
    with on("cpu") as cpu:
        want = _attend(_ring(0.0), inputs, cpu)  # the CPU's blocks: its flash kernel
    monkeypatch.setattr(blocks, "FUSED", False)  # on the CPU too, the plain blocks a GPU runs in fp32
    with on(target) as dev:
        got = _attend(_ring(0.0), inputs, dev)
    assert_close(got, want, OP_FP32, f"ring blocks on {target}")


@targets("the CP ring's blocks on the device's flash kernel in bf16 (compat.cuda_flash_attention)")
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_ring_blocks_bf16_fused_match_fp32(target, documents):
    inputs = _ring_inputs(documents)
    with on(target) as dev:
        want = _attend(_ring(0.0), inputs, dev)  # fp32: the plain blocks on CUDA, the flash kernel on the CPU
        got = _attend(_ring(0.0), inputs, dev, torch.bfloat16)
    for name in want:
        err, scale = float((got[name] - want[name]).abs().max()), float(want[name].abs().max())
        assert err <= 3e-2 * max(scale, 1.0), f"bf16 ring {name} on {target}: {err:.3e} (largest {scale:.2f})"


def _explicit_dropout_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: None, p: float = 0.1
                                ) -> torch.Tensor:
    """softmax(QK^T) with the ring's dropout masks, drawn in its order: one per piece of its two chunks
    (the first against itself, the second against the first, the second against itself), then V."""
    b, nq, s, d = q.shape
    g, h = k.shape[1], s // 2
    keep = torch.zeros(b, nq, s, s, device=q.device)
    for rows, cols in ((slice(0, h), slice(0, h)), (slice(h, s), slice(0, h)), (slice(h, s), slice(h, s))):
        keep[:, :, rows, cols] = blocks.dropout_keep(q[:, :, rows], h, p)
    k, v = (t.repeat_interleave(nq // g, dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * d ** -0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (scores.softmax(dim=-1) * keep) @ v


@targets("dropout in the CP ring's blocks, redrawn in backward from the device generator's saved state")
def test_ring_dropout_replays_the_device_generator(target, monkeypatch):
    monkeypatch.setattr(blocks, "ROW_TILE", 8)
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
