"""Promises of data parallelism and the optimizer:
- DP in {2, 4}, with and without the distributed optimizer, with TP=2 and with PP=2, with overlapped
  reduction and small buckets, give the single-process loss curve and grad norm (fp32, rel <= 1e-5);
- the gradient buffer is reduced once per step (bytes = buffer size), not once per micro-batch;
- an overflow on one rank only makes every rank skip the step together."""

from __future__ import annotations

import pytest
import torch

from megalite.config.arguments import MegaliteConfig
from megalite.config.model import ModelConfig
from megalite.distributed.finalize import finalize_grads
from megalite.distributed.grad_buffer import GradBuffer
from megalite.optimizer.optimizer import MegaliteOptimizer
from megalite.parallel.groups import ProcessGroups
from megalite.training.loop import TrainResult
from tests.harness import run_ranks
from tests.layouts import assert_matches_serial, layout_curves, serial_curve
from tests.tp_utils import GPT2, LLAMA_GQA, build, groups_for, layout_cfg, layout_flat

VOCAB = 500
ITERS = 5
MODEL = {**LLAMA_GQA, "num_layers": 4, "hidden_size": 32, "untie_embeddings_and_output_weights": False}
# name -> (tp, pp, extra flags)
LAYOUTS = {
    "dp4": (1, 1, {}),
    "dp4_distopt": (1, 1, {"use_distributed_optimizer": True}),
    "dp4_distopt_overlap_small_buckets": (1, 1, {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
                                                 "overlap_param_gather": True, "ddp_bucket_size": 3000}),
    "dp4_overlap_small_buckets": (1, 1, {"overlap_grad_reduce": True, "ddp_bucket_size": 3000}),
    "tp2_dp2_distopt": (2, 1, {"use_distributed_optimizer": True}),
    "pp2_dp2_distopt_overlap": (1, 2, {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
                                       "ddp_bucket_size": 5000}),
    "pp2_dp2": (1, 2, {}),
}


GLOBAL_BATCH = 8  # 2 micro-batches per rank at DP 4: gradients accumulate before the one reduction


def make_cfg(tp: int = 1, pp: int = 1, **extra) -> MegaliteConfig:
    return layout_cfg(MODEL, vocab=VOCAB, iters=ITERS, tp=tp, pp=pp, global_batch_size=GLOBAL_BATCH, **extra)


def flat(tp: int = 1, pp: int = 1, **extra) -> dict:
    return layout_flat(MODEL, vocab=VOCAB, iters=ITERS, tp=tp, pp=pp, global_batch_size=GLOBAL_BATCH, **extra)


def _all_reduce_bytes(res: TrainResult, pg: ProcessGroups) -> tuple[int, int]:
    """(DP bytes all-reduced, the gradient buffer's bytes once per step)."""
    grad_bytes = sum(b.grad_data.numel() * 4 for b in res.optimizer.buffers)
    return pg.comm_bytes[("dp", "grad_all_reduce")], grad_bytes * ITERS


def _distopt_bytes(res: TrainResult, pg: ProcessGroups) -> tuple[int, int]:
    """(DP bytes reduce-scattered and all-gathered, the parameter buffer's bytes twice per step)."""
    param_bytes = sum(b.param_data.numel() * 4 for b in res.optimizer.buffers)
    moved = pg.comm_bytes[("dp", "grad_reduce_scatter")] + pg.comm_bytes[("dp", "param_all_gather")]
    return moved, 2 * param_bytes * ITERS


@pytest.fixture(scope="module")
def curves() -> list[dict]:
    runs = {name: flat(tp, pp, **extra) for name, (tp, pp, extra) in LAYOUTS.items()}
    return layout_curves(4, runs, extract={"dp4": _all_reduce_bytes, "dp4_distopt": _distopt_bytes})


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_dp_loss_curve_and_grad_norm_match_serial(curves, layout):
    assert_matches_serial(curves, layout, serial_curve(flat()), ITERS)


def test_gradient_buffer_reduced_once_per_step(curves):
    # 8 micro-batches per step at DP=1, 2 per DP rank at DP=4: still one reduction of the buffer per step.
    for c in curves:
        measured, expected = c["dp4"].extra
        assert measured == expected
        measured, expected = c["dp4_distopt"].extra
        assert measured == expected  # reduce-scatter + all-gather move the same volume as one all-reduce


def _overflow_on_one_rank(rank: int, world: int) -> dict:
    pg = groups_for(world, rank, tp=2)
    cfg = make_cfg(2, 1, fp16=True, initial_loss_scale=1024.0, hysteresis=2, use_distributed_optimizer=True)
    model = build(ModelConfig(**GPT2), pg, VOCAB)
    buffers = [GradBuffer(list(model.parameters()), pg, grad_dtype=torch.float32, distributed=True)]
    opt = MegaliteOptimizer(buffers, cfg, pg)
    before = [p.detach().clone() for p in model.parameters()]
    results = []
    for step in range(3):
        for b in buffers:
            b.grad_data.fill_(1.0)
            if rank == 3 and step < 2:
                b.grad_data[-1] = float("inf")  # only rank 3 overflows, in the shard DP rank 1 owns
        finalize_grads([model], buffers, pg)
        r = opt.step(1e-3, 1.0)
        results.append((r.skipped, opt.loss_scale))
    unchanged_after_skips = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return {"results": results, "unchanged": unchanged_after_skips}


def test_overflow_on_one_rank_skips_everywhere():
    out = run_ranks(_overflow_on_one_rank, 4)
    for rank, o in enumerate(out):
        # two skipped steps (hysteresis 2 halves the scale on the second), then a real step
        assert o["results"] == [(True, 1024.0), (True, 512.0), (False, 512.0)], f"rank {rank}: {o['results']}"
        assert not o["unchanged"], "the third step must update the parameters"
