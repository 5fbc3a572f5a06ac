"""--grad-compression powersgd|int8 on the DP all-reduce:
- PowerSGD at full rank reproduces its input (one rank) and trains like the uncompressed run at DP 2;
- error feedback makes the accumulated compressed updates converge to the accumulated gradients (without
  it they do not);
- int8 quantise/dequantise stays within half a quantisation step; an all-zero row stays zero;
- the DP bytes counted in pg.comm_bytes drop by the formula (warm-up steps uncompressed);
- with --hierarchical-dp-reduce only the inter-node part is compressed (2 nodes x 2 ranks);
- the sharded (distributed optimizer) path is refused by name."""

from __future__ import annotations

import pytest
import torch

from megalite.config import ConfigError, validate
from megalite.distributed.compression import GradCompressor, int8_bytes, matrix_layout, matrix_shape, powersgd_bytes
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.training.loop import pretrain
from tests.asserts import assert_rel_close
from tests.harness import run_ranks
from tests.tp_utils import LLAMA_GQA, layout_cfg, mock_data

VOCAB = 500
ITERS = 6
WARMUP = 2
MODEL = {**LLAMA_GQA, "num_layers": 2, "hidden_size": 32, "untie_embeddings_and_output_weights": False}


# ---- the compressor alone (one rank: the all-reduces are the identity) -----------------------------
def test_powersgd_full_rank_reproduces_input():
    comp = GradCompressor("powersgd", ProcessGroups.single(), rank=10_000)
    for n in (1000, 37, 4096):
        rows, cols = matrix_shape(n)
        assert rows * cols >= n and abs(rows - cols) <= 1
        for _ in range(3):  # the first call (seeded Q) and the warm-started ones
            x = torch.randn(n)
            data = x.clone()
            assert comp.all_reduce(data, "dp", key=n)
            assert torch.allclose(data, x, atol=1e-4), (data - x).abs().max()


def test_powersgd_compresses_each_matrix_in_its_shape():
    comp = GradCompressor("powersgd", ProcessGroups.single(), rank=10_000)
    layout = [(0, 6, 4), (30, 3, 5)]  # a 6x4 matrix, a 6-element vector, a 3x5 matrix
    x = torch.randn(45)
    data = x.clone()
    comp.all_reduce(data, "dp", key=0, layout=layout)
    assert torch.allclose(data, x, atol=1e-5)
    assert [tuple(q.shape) for q in comp.qs[0]] == [(4, 4), (5, 3)]  # full rank: min(rows, cols)
    assert torch.equal(comp.errors[0][24:30], torch.zeros(6))  # the vector travelled exact
    assert powersgd_bytes(45, 1, layout) == 4 * (1 * 10 + 1 * 8 + 6)


def test_powersgd_low_rank_bytes_formula():
    rows, cols = matrix_shape(10_000)
    assert (rows, cols) == (100, 100) and powersgd_bytes(10_000, 4) == 4 * 4 * 200
    assert int8_bytes(10, 4) == 2 * 4 * 3 + 32


def _accumulated_error(method: str, feedback: bool, steps: int) -> float:
    torch.manual_seed(0)
    comp = GradCompressor(method, ProcessGroups.single(), rank=1, error_feedback=feedback)
    signal = torch.randn(32, 32) * 0.1  # full-rank mean gradient, plus noise every step
    total_in, total_out = torch.zeros(1024), torch.zeros(1024)
    for _ in range(steps):
        g = (signal + 0.05 * torch.randn(32, 32)).reshape(-1)
        out = g.clone()
        comp.all_reduce(out, "dp", key=0)
        total_in += g
        total_out += out
    return float((total_out - total_in).norm() / total_in.norm())


@pytest.mark.parametrize("method", ["powersgd", "int8"])
def test_error_feedback_makes_accumulated_update_converge(method):
    with_ef = [_accumulated_error(method, True, t) for t in (20, 200)]
    without = _accumulated_error(method, False, 200)
    assert with_ef[1] < with_ef[0] / 4, with_ef  # the error stays bounded: relative error falls like 1/t
    assert with_ef[1] < without / 5, (with_ef, without)
    if method == "powersgd":  # rank 1 of a full-rank matrix: without feedback most of it is lost for good
        assert without > 0.5 and with_ef[1] < 0.15


def test_int8_quantize_bounds():
    x = torch.cat([torch.randn(3, 1000) * torch.tensor([[1.0], [1e-3], [50.0]]), torch.zeros(1, 1000)])
    q, scale = GradCompressor.quantize(x)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    back = GradCompressor.dequantize(q, scale)
    assert torch.all((back - x).abs() <= scale.unsqueeze(-1) / 2 * (1 + 1e-6))
    assert torch.equal(back[3], torch.zeros(1000))
    assert torch.allclose(scale[:3], x[:3].abs().amax(dim=1) / 127)


def test_overflow_passes_through_and_resets_state():
    comp = GradCompressor("powersgd", ProcessGroups.single(), rank=2)
    data = torch.randn(400)
    data[7] = float("inf")
    comp.all_reduce(data, "dp", key=0)
    assert not torch.isfinite(data).all()  # every rank sees non-finite: the step is skipped
    assert torch.equal(comp.errors[0], torch.zeros(400)) and 0 not in comp.qs


# ---- training at DP 2 and 2 nodes x 2 -------------------------------------------------------------
def make_cfg(**extra):
    return layout_cfg(MODEL, vocab=VOCAB, iters=ITERS, **extra)


def _grad_bytes(res) -> list[tuple[int, list]]:
    """(elements, weight-matrix layout) of every bucket."""
    return [(b.numel, matrix_layout(b.params, buf.ranges, b.start)) for buf in res.optimizer.buffers
            for b in buf.buckets]


def _dp2(rank: int, world: int) -> dict:
    data = mock_data(VOCAB, MODEL["seq_length"], 1234, ITERS * 8)
    out = {}
    for name, extra in {"none": {}, "full": {"grad_compression": "powersgd", "powersgd_rank": 10_000},
                        "powersgd": {"grad_compression": "powersgd", "powersgd_rank": 2},
                        "int8": {"grad_compression": "int8"}}.items():
        cfg = make_cfg(grad_compression_warmup_steps=WARMUP, ddp_bucket_size=4000, **extra)
        validate(cfg, world)
        pg = ProcessGroups.build(RankLayout(world), rank)
        res = pretrain(cfg, pg, data=data, log=lambda s: None)
        out[name] = {"losses": res.losses, "norms": res.grad_norms, "buckets": _grad_bytes(res),
                     "bytes": {k[1]: v for k, v in pg.comm_bytes.items() if k[0] == "dp" and k[1].startswith("grad")}}
    return out


@pytest.fixture(scope="module")
def dp2() -> list[dict]:
    return run_ranks(_dp2, 2, timeout=400)


def test_powersgd_full_rank_trains_as_uncompressed(dp2):
    for c in dp2:
        assert_rel_close(c["full"]["losses"], c["none"]["losses"], 1e-4, "full-rank PowerSGD loss")
        assert_rel_close(c["full"]["norms"], c["none"]["norms"], 1e-3, "full-rank PowerSGD grad norm")
        for method in ("powersgd", "int8"):  # approximate, but training
            assert c[method]["losses"][-1] < c[method]["losses"][0]
            assert_rel_close(c[method]["losses"], c["none"]["losses"], 5e-2, f"{method} loss")


def test_dp_bytes_drop_by_the_formula(dp2):
    for c in dp2:
        buckets = c["none"]["buckets"]
        assert len(buckets) > 1  # several buckets, each compressed on its own
        exact = sum(4 * n for n, _ in buckets)
        assert c["none"]["bytes"] == {"grad_all_reduce": exact * ITERS}
        compressed = ITERS - WARMUP
        ps = c["powersgd"]["bytes"]
        assert ps.pop("grad_all_reduce") == exact * WARMUP
        assert sum(ps.values()) == compressed * sum(powersgd_bytes(n, 2, layout) for n, layout in buckets)
        i8 = c["int8"]["bytes"]
        assert i8.pop("grad_all_reduce") == exact * WARMUP
        assert sum(i8.values()) == compressed * sum(int8_bytes(n, 2) for n, _ in buckets)
        assert sum(i8.values()) < 0.6 * exact * compressed and sum(ps.values()) < 0.2 * exact * compressed


def _hierarchical(rank: int, world: int) -> dict:
    data = mock_data(VOCAB, MODEL["seq_length"], 1234, ITERS * 8)
    cfg = make_cfg(hierarchical_dp_reduce=True, grad_compression="powersgd", powersgd_rank=2)
    validate(cfg, world, local_world_size=2)
    pg = ProcessGroups.build(RankLayout(world, local_world_size=2), rank, hierarchical_dp=True)
    res = pretrain(cfg, pg, data=data, log=lambda s: None)
    return {"bytes": {k: v for k, v in pg.comm_bytes.items() if k[1].startswith("grad")},
            "buffer": sum(b.grad_data.numel() * 4 for b in res.optimizer.buffers), "losses": res.losses}


def test_hierarchical_compresses_only_the_inter_node_part():
    for c in run_ranks(_hierarchical, 4, timeout=300):
        kinds = {k for k in c["bytes"]}
        assert c["bytes"][("dp_intra", "grad_reduce_scatter")] == c["buffer"] * ITERS  # exact inside a node
        assert c["bytes"][("dp_intra", "grad_all_gather")] == c["buffer"] * ITERS
        assert ("dp_inter", "grad_all_reduce") not in kinds and ("dp_inter", "grad_powersgd_p") in kinds
        assert c["losses"][-1] < c["losses"][0]


def test_refused_with_the_distributed_optimizer():
    with pytest.raises(ConfigError) as e:
        validate(make_cfg(grad_compression="int8", use_distributed_optimizer=True), 2)
    assert "--grad-compression int8" in str(e.value) and "--use-distributed-optimizer" in str(e.value)
    with pytest.raises(ConfigError, match=r"--powersgd-rank must be an integer in \[1, "):
        validate(make_cfg(grad_compression="powersgd", powersgd_rank=0), 2)
