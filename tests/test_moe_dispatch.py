"""Promise: token dispatch moves every kept (token, expert) assignment to the rank holding that expert and
back, losing nothing (docs/moe.md, megalite/moe/dispatch.py).

On 4 real gloo ranks, layouts EP 1, 2 and 4, EP 2 x expert-TP 2 (the alltoall dispatcher's expert-TP
gather path) and EP 2 x expert-TP 1 under TP 2:

- round trip: with an identity "expert" (each expert-TP rank hands back 1/etp of its rows, so the partial
  sums add up to the rows) and top-2 weights 0.5 + 0.5, combine(dispatch(x)) is x and its gradient is the
  incoming one, bit for bit; with capacity (some assignments dropped, one expert dropped entirely) only the
  kept halves come back; with --moe-pad-expert-input-to-capacity every expert's input is padded to the
  capacity per source rank. Each local expert's rows are exactly the kept tokens of the expert-model-
  parallel group that name it.
- the whole MoE layer (router with aux and z losses, SwiGLU experts, random routing) gives the single-
  process layer's output, input gradient and expert weight gradients (this rank's shard) at 1e-6 with
  both dispatchers, and the two dispatchers agree with each other at 1e-6; with --moe-grouped-gemm too.
- ``grouped_linear`` with torch._grouped_mm equals the per-expert loop, forward and backward, with experts
  that receive no tokens.

Everything multi-rank runs under MEGALITE_NCCL_SEMANTICS=1 (NCCL's communicator rules emulated on gloo).
"""

from __future__ import annotations

import pytest
import torch

from megalite import compat
from megalite.config.model import ModelConfig
from megalite.moe.dispatch import make_dispatcher
from megalite.moe.experts import grouped_linear
from megalite.moe.layer import MoELayer
from megalite.moe.router import Routing, capacity
from megalite.parallel.groups import Group, ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.param_meta import EXPERT, local_shard, param_meta
from megalite.tensor_parallel.random import RNGTracker
from tests.harness import run_ranks
from tests.layouts import p2p_mode

WORLD, E, K, T, H = 4, 4, 2, 12, 8
LAYOUTS = {"ep1": dict(), "ep2": dict(ep=2), "ep4": dict(ep=4), "ep2_etp2": dict(tp=2, ep=2, etp=2),
           "ep2_tp2_etp1": dict(tp=2, ep=2, etp=1)}
MODES = ["dropless", "capacity", "pad"]
DISPATCHERS = ["alltoall", "allgather"]
PAD_FACTOR = 1.0


# ---- the round trip -----------------------------------------------------------------------------------
def rank_tokens(rank: int, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens [T, H], its two distinct experts per token [T, 2] and the kept mask [T, 2]
    (the same on every rank that asks: each rank can rebuild the others' tokens)."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g)
    experts = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if mode == "dropless":
        kept = torch.ones(T, K, dtype=torch.bool)
    elif mode == "capacity":  # some assignments dropped, and every assignment to expert 3 (an empty expert)
        kept = (torch.rand(T, K, generator=g) > 0.3) & (experts != 3)
    else:  # by position within each expert's capacity, as the router drops them
        routed = torch.zeros(T, E, dtype=torch.bool).scatter(1, experts, True)
        cap = capacity(T, K, E, PAD_FACTOR)
        kept = (routed & (routed.long().cumsum(0) <= cap)).gather(1, experts)
    return x, experts, kept


def expected_rows(pg: ProcessGroups, mode: str, local_expert: int) -> torch.Tensor:
    """The kept rows naming this rank's ``local_expert`` from every rank of its expert-model-parallel group,
    sorted by their first column (the dispatchers order sources differently)."""
    e = pg.ep_rank * (E // pg.ep_size) + local_expert
    rows = []
    for r in pg.ranks[Group.EMP]:
        x, experts, kept = rank_tokens(r, mode)
        rows.append(x[((experts == e) & kept).any(1)])
    rows = torch.cat(rows)
    return rows[rows[:, 0].argsort()]


def _round_trip(pg: ProcessGroups, kind: str, mode: str, rank: int) -> dict:
    x, experts, kept = rank_tokens(rank, mode)
    x = x.clone().requires_grad_()
    probs = torch.full((T, K), 0.5, requires_grad=True)
    pad = PAD_FACTOR if mode == "pad" else None
    d = make_dispatcher(kind, E, pg, K, pad)
    rows, counts, st = d.dispatch(x, Routing(probs, experts, kept, None, torch.zeros(E)))
    local_rows = rows.detach().split(counts)
    out = d.combine(rows / pg.etp_size, st)  # identity expert; expert-TP partial sums add up to the rows
    dout = torch.randn(T, H, generator=torch.Generator().manual_seed(7 + rank))
    out.backward(dout)
    share = 0.5 * kept.sum(1, keepdim=True)
    res = {"out": torch.equal(out.detach(), x.detach() * share), "dx": torch.equal(x.grad, dout * share),
           "dprobs": float((probs.grad - (dout * x.detach()).sum(1, keepdim=True) * kept).abs().max()),
           "rows": True, "counts": list(counts)}
    for i, got in enumerate(local_rows):
        if mode == "pad":  # padding rows are zeros
            got = got[got.abs().sum(1) > 0]
        got = got[got[:, 0].argsort()]
        want = expected_rows(pg, mode, i)
        res["rows"] &= got.shape == want.shape and torch.equal(got, want)
    return res


# ---- the whole layer ----------------------------------------------------------------------------------
S, B, HL, FFN = 8, 2, 16, 8


def layer_cfg(kind: str, grouped: bool) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=HL, num_attention_heads=2, ffn_hidden_size=FFN, num_experts=E,
                       moe_router_topk=K, swiglu=True, disable_bias_linear=True, moe_aux_loss_coeff=0.01,
                       moe_z_loss_coeff=0.001, moe_token_dispatcher_type=kind, moe_grouped_gemm=grouped)


def full_weights(layer: MoELayer) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {n: torch.randn(param_meta(p).full_shape, generator=g) * 0.3 for n, p in layer.named_parameters()}


def sequence_part(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s [S, B, HL] input and output gradient (with TP, its TP group's sequence is the
    TP ranks' parts one after another)."""
    g = torch.Generator().manual_seed(200 + rank)
    return torch.randn(S, B, HL, generator=g), torch.randn(S, B, HL, generator=g)


def _reference(layout: RankLayout, tp_group: list[int], kind: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The single-process layer on one TP group's whole sequences: output, input grad, weight grads."""
    layer = MoELayer(layer_cfg(kind, False), BuildContext(ProcessGroups.single(), RNGTracker()), 0)
    with torch.no_grad():
        full = full_weights(layer)
        for n, p in layer.named_parameters():
            p.copy_(full[n])
    parts = [sequence_part(r) for r in tp_group]
    x = torch.cat([p[0] for p in parts]).requires_grad_()
    out = layer(x)
    out.backward(torch.cat([p[1] for p in parts]))
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def _layer(pg: ProcessGroups, kind: str, grouped: bool, rank: int) -> dict:
    """This rank's errors against the reference, and its output and input gradient (for the comparison of
    the dispatchers)."""
    layout, tp = pg.layout, pg.tp_size
    layer = MoELayer(layer_cfg(kind, grouped), BuildContext(pg, RNGTracker(), sequence_parallel=tp > 1), 0)
    with torch.no_grad():
        full = full_weights(layer)
        for n, p in layer.named_parameters():
            p.copy_(local_shard(param_meta(p), full[n], pg))
    x, dout = sequence_part(rank)
    x.requires_grad_()
    out = layer(x)
    out.backward(dout)
    # output and input grad: this rank's part of its TP group's reference; expert weight grads: the sum
    # over the TP groups whose tokens reach this rank's experts (its expert-model-parallel group's)
    refs = {tuple(g): _reference(layout, g, kind) for g in layout.groups("tp")}
    ref_out, ref_dx, _ = refs[tuple(pg.ranks[Group.TP])]
    part = slice(pg.tp_rank * S, (pg.tp_rank + 1) * S)
    groups = {tuple(layout.group_of(r, "tp")) for r in pg.ranks[Group.EMP]}
    errs = {"out": float((out.detach() - ref_out[part]).abs().max() / ref_out.abs().max()),
            "dx": float((x.grad - ref_dx[part]).abs().max() / ref_dx.abs().max())}
    for name, p in layer.named_parameters():
        if param_meta(p).family is not EXPERT:
            continue
        want = local_shard(param_meta(p), sum(refs[g][2][name] for g in groups), pg)
        errs[name] = float((p.grad - want).abs().max() / want.abs().max())
    return {"errs": errs, "out": out.detach(), "dx": x.grad}


def _all_cases(rank: int, world: int) -> dict:
    res = {}
    for name, kw in LAYOUTS.items():
        pg = ProcessGroups.build(RankLayout(world, **kw), rank)
        for kind in DISPATCHERS:
            for mode in MODES:
                if mode == "pad" and kind == "allgather":  # padding is the alltoall dispatcher's
                    continue
                res[("trip", name, kind, mode)] = _round_trip(pg, kind, mode, rank)
            for grouped in (False, True):
                if grouped and name not in ("ep2", "ep2_etp2"):
                    continue
                res[("layer", name, kind, grouped)] = _layer(pg, kind, grouped, rank)
    return res


@pytest.fixture(scope="module")
def results() -> list[dict]:
    with p2p_mode("nccl_semantics"):  # stricter than gloo, same numbers: no plain-gloo twin needed
        return run_ranks(_all_cases, WORLD, timeout=240)


TRIPS = [(n, k, m) for n in LAYOUTS for k in DISPATCHERS for m in MODES if not (m == "pad" and k == "allgather")]


@pytest.mark.parametrize("layout,kind,mode", TRIPS)
def test_round_trip_restores_the_kept_part_exactly(results, layout, kind, mode):
    for rank, res in enumerate(results):
        r = res[("trip", layout, kind, mode)]
        assert r["out"] and r["dx"], f"rank {rank}: output or input gradient not exact"
        assert r["dprobs"] <= 1e-6, f"rank {rank}: probability gradient off by {r['dprobs']:.2e}"
        assert r["rows"], f"rank {rank}: the local experts' rows are not the kept tokens that name them"
        if mode == "pad":  # every expert's rows from every source rank (EP x expert-TP) padded to the capacity
            kw = LAYOUTS[layout]
            sources = kw.get("ep", 1) * kw.get("etp", kw.get("tp", 1))
            assert r["counts"] == [capacity(T, K, E, PAD_FACTOR) * sources] * (E // kw.get("ep", 1))


LAYER_CASES = [(n, k, g) for n in LAYOUTS for k in DISPATCHERS for g in (False, True)
               if not g or n in ("ep2", "ep2_etp2")]


@pytest.mark.parametrize("layout,kind,grouped", LAYER_CASES)
def test_layer_equals_single_process(results, layout, kind, grouped):
    for rank, res in enumerate(results):
        for what, err in res[("layer", layout, kind, grouped)]["errs"].items():
            assert err <= 1e-6, f"rank {rank} {what}: relative error {err:.2e}"


@pytest.mark.parametrize("layout,grouped", sorted({(n, g) for n, _, g in LAYER_CASES}))
def test_dispatchers_agree(results, layout, grouped):
    for rank, res in enumerate(results):
        a, b = res[("layer", layout, "alltoall", grouped)], res[("layer", layout, "allgather", grouped)]
        for what in ("out", "dx"):
            err = float((a[what] - b[what]).abs().max() / b[what].abs().max())
            assert err <= 1e-6, f"rank {rank} {what}: alltoall vs allgather {err:.2e}"


# ---- grouped GEMM -------------------------------------------------------------------------------------
@pytest.mark.skipif(not compat.grouped_mm_supported("cpu", torch.float32),
                    reason="this torch runs no grouped GEMM in fp32 on the CPU")
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 7, 0], [4, 4, 4, 4]])
@pytest.mark.parametrize("fan_in,fan_out", [(8, 12), (8, 6)])
def test_grouped_gemm_equals_the_loop(counts, fan_in, fan_out):
    """(8, 6): 24-byte rows, which _grouped_mm refuses: the loop runs instead."""
    g = torch.Generator().manual_seed(3)
    x0, w0 = torch.randn(sum(counts), fan_in, generator=g), torch.randn(len(counts), fan_out, fan_in, generator=g)
    dout = torch.randn(sum(counts), fan_out, generator=g)
    got = {}
    for grouped in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = grouped_linear(x, w, counts, grouped)
        y.backward(dout)
        got[grouped] = (y.detach(), x.grad, w.grad)
        if grouped:  # the grouped kernel ran where the sizes allow it
            assert (type(y.grad_fn).__name__ == "_ContiguousGradBackward") == (fan_out == 12)
    for name, a, b in zip(("out", "dx", "dw"), got[True], got[False]):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), f"{name}: {(a - b).abs().max():.2e}"
    empty = [e for e, c in enumerate(counts) if c == 0]
    assert torch.equal(got[True][2][empty], torch.zeros_like(w0[empty]))  # no tokens, no gradient


# ---- device placement ---------------------------------------------------------------------------------
def test_padding_keeps_the_tokens_device():
    """--moe-pad-expert-input-to-capacity builds its index tensors on the tokens' device, not the default
    one (on a GPU, CPU index tensors fail index_copy). A different default device stands in for the GPU."""
    disp = make_dispatcher("alltoall", E, ProcessGroups.single(), K, PAD_FACTOR)
    token, prob, counts = torch.tensor([0, 2, 1, 3]), torch.full((4,), 0.5), torch.tensor([2, 0, 1, 1])
    with torch.device("meta"):
        tok, pr, padded = disp._padded(token, prob, counts, T)
    cap = capacity(T, K, E, PAD_FACTOR)
    assert tok.device == pr.device == torch.device("cpu")
    assert padded.tolist() == [cap] * E
    assert tok.view(E, cap)[0, :2].tolist() == [0, 2] and tok.view(E, cap)[1].tolist() == [T] * cap
