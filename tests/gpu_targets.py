"""The two targets of the GPU-path tests (tests/test_gpu_paths*.py) and what they compare: a run on ``cuda``
(skipped without a GPU) or CPU against CPU (MEGALITE_FORCE_CPU=1), the tolerances, the tiny training runs.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from megalite import device
from megalite.config import validate
from megalite.config.arguments import MegaliteConfig
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.training.loop import TrainResult, pretrain
from tests.asserts import assert_rel_close
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


