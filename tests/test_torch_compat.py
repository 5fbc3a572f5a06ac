"""Promise (docs/compatibility.md): megalite runs on every torch from the minimum, because every newer or
private API is reached through ``megalite.compat`` with a fallback. Here the newer APIs are hidden, as an
older torch lacks them (the flat collectives' 2.13 names are deleted from ``torch.distributed``, grouped
GEMM, SDPA's ``enable_gqa``, the CPU flash kernel, the default store, the autograd graph-task id, the fused
foreach multiply), and a small multi-rank set trains on the fallbacks: TP2 with SP, the distributed
optimizer at DP2, ZeRO-3 with recompute, EP2 with both dispatchers (grouped GEMM asked for), CP2 with each
comm type and PP2 under MEGALITE_NCCL_SEMANTICS=1, each equal to the single-process curve with every API
present (fp32, 1e-5). On the code before ``compat`` the first all-gather died: 'module torch.distributed
has no attribute all_gather_single'."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite import compat
from megalite.config import validate
from tests.asserts import assert_rel_close
from tests.harness import run_ranks
from tests.layouts import layout_curves, serial_curve
from tests.tp_utils import LLAMA_GQA, layout_cfg, layout_flat

VOCAB, ITERS = 128, 4
DENSE = {**LLAMA_GQA, "seq_length": 32}
MOE = {**DENSE, "num_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01, "moe_grouped_gemm": True}
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
# name -> (model, tp, pp, cp, ep, extra flags, NCCL semantics)
LAYOUTS = {
    "tp2_sp": ("dense", 2, 1, 1, 1, {"sequence_parallel": True}, False),
    "dp2_distributed_optimizer": ("dense", 1, 1, 1, 1, {"use_distributed_optimizer": True}, False),
    "dp2_zero3_recompute": ("dense", 1, 1, 1, 1,
                            {"data_parallel_sharding_strategy": "optim_grads_params", **RECOMPUTE}, False),
    "ep2_alltoall": ("moe", 1, 1, 1, 2, {"moe_token_dispatcher_type": "alltoall"}, False),
    "ep2_allgather": ("moe", 1, 1, 1, 2, {"moe_token_dispatcher_type": "allgather"}, False),
    "cp2_p2p": ("dense", 1, 1, 2, 1, {"cp_comm_type": "p2p"}, False),
    "cp2_a2a": ("dense", 1, 1, 2, 1, {"cp_comm_type": "a2a"}, False),
    "cp2_allgather": ("dense", 1, 1, 2, 1, {"cp_comm_type": "allgather"}, False),
    "pp2_nccl_semantics": ("dense", 1, 2, 1, 1, {}, True),
}
MODELS = {"dense": DENSE, "moe": MOE}


class _Without:
    """A namespace that has nothing: where compat looks for an API a test hides."""


def hide_newer_apis() -> None:
    """Make this process look like an older torch to megalite (irreversible: call in a rank process)."""
    for name in ("all_gather_single", "reduce_scatter_single"):  # torch itself reaches them another way
        if hasattr(dist, name):
            delattr(dist, name)
    for name, (_, attr) in list(compat.OPTIONAL_APIS.items()):
        compat.OPTIONAL_APIS[name] = (_Without(), attr)
    real_sdpa, real_aten = F.scaled_dot_product_attention, torch.ops.aten

    def sdpa_without_gqa(*args, **kwargs):  # torch < 2.5
        if "enable_gqa" in kwargs:
            raise TypeError("scaled_dot_product_attention() got an unexpected keyword argument 'enable_gqa'")
        return real_sdpa(*args, **kwargs)

    class AtenWithoutCpuFlash:
        def __getattr__(self, name: str):
            if name.startswith("_scaled_dot_product_flash_attention_for_cpu"):
                raise AttributeError(name)
            return getattr(real_aten, name)

    F.scaled_dot_product_attention = sdpa_without_gqa
    torch.ops.aten = AtenWithoutCpuFlash()
    compat.reset()


def _older_torch() -> None:
    """Each rank, before its runs: the newer APIs hidden, and compat seeing them gone."""
    hide_newer_apis()
    assert not compat.grouped_mm_supported("cpu", torch.float32) and compat.cpu_flash_attention() is None
    assert not compat.sdpa_has_gqa()


def flat(model: str, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, **extra) -> dict:
    return layout_flat(MODELS[model], vocab=VOCAB, iters=ITERS, tp=tp, pp=pp, context_parallel_size=cp,
                       expert_model_parallel_size=ep, **extra)


@pytest.fixture(scope="module")
def curves() -> list[dict]:
    runs = {name: flat(model, tp, pp, cp, ep, **extra) for name, (model, tp, pp, cp, ep, extra, _) in LAYOUTS.items()}
    modes = {name: "nccl_semantics" if nccl else "gloo" for name, (*_, nccl) in LAYOUTS.items()}
    return layout_curves(2, runs, modes, prepare=_older_torch)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_older_torch_api_trains_the_serial_curve(curves, layout):
    # the reference: one process (this one, which hides nothing), every API present
    assert not any(isinstance(where, _Without) for where, _ in compat.OPTIONAL_APIS.values())
    ref = serial_curve(layout_flat(MODELS[LAYOUTS[layout][0]], vocab=VOCAB, iters=ITERS))
    assert len(set(ref.losses)) == ITERS
    for rank, c in enumerate(curves):
        assert_rel_close(c[layout].losses, ref.losses, 1e-5,
                         f"{layout} rank {rank}: loss vs serial (newer APIs hidden)")
        assert_rel_close(c[layout].grad_norms, ref.grad_norms, 1e-5, f"{layout} rank {rank}: grad norm vs serial")


# ---- each fallback against the API it replaces, in one process ----------------------------------------
def test_sdpa_fallback_equals_enable_gqa(monkeypatch):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 8, 5, 4, generator=g), torch.randn(2, 2, 5, 4, generator=g), torch.randn(2, 2, 5, 4)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(compat.sdpa(q, k, v, is_causal=True), want)
    monkeypatch.setattr(compat, "sdpa_has_gqa", lambda: False)
    torch.testing.assert_close(compat.sdpa(q, k, v, is_causal=True), want, rtol=1e-6, atol=1e-6)


def test_scale_fallback_equals_foreach(monkeypatch):
    a, b = [torch.ones(3), torch.arange(4.0)], [torch.ones(3), torch.arange(4.0)]
    compat.scale_(a, 0.5)
    monkeypatch.setitem(compat.OPTIONAL_APIS, "_foreach_mul_", (_Without(), "_foreach_mul_"))
    compat.scale_(b, 0.5)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_in_backward_fallback_sees_recomputation(monkeypatch):
    """Without the graph-task id, megalite's own mark (set by recompute's replay) answers the same."""
    seen = []

    def record(x):
        seen.append(compat.in_backward())
        return x * 2

    from megalite.tensor_parallel.random import RNGTracker
    from megalite.tensor_parallel.recompute import recompute

    for hidden in (False, True):
        if hidden:
            monkeypatch.setitem(compat.OPTIONAL_APIS, "_current_graph_task_id", (_Without(), "x"))
        seen.clear()
        x = torch.ones(3, requires_grad=True)
        recompute(record, RNGTracker(), x).sum().backward()
        assert seen == [False, True], (hidden, seen)


def test_grouped_mm_missing_warns_once_and_loops(monkeypatch):
    monkeypatch.setitem(compat.OPTIONAL_APIS, "_grouped_mm", (_Without(), "_grouped_mm"))
    compat.reset()
    try:
        assert not compat.grouped_mm_supported("cpu", torch.float32)
        msg = compat.grouped_mm_warning("cpu", torch.float32)
        assert msg and "--moe-grouped-gemm" in msg and "one GEMM each" in msg
    finally:
        compat.reset()


def test_too_old_names_the_floor(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.5.1+cu124")
    assert "needs torch >= 2.6" in compat.too_old()
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert compat.too_old() is None


def _store_round_trip(rank: int, world: int) -> bytes:
    compat.OPTIONAL_APIS["_get_default_store"] = (_Without(), "_get_default_store")
    store = compat.default_store()
    store.set(f"k{rank}", str(rank))
    return store.get(f"k{1 - rank}")


def test_default_store_fallback_is_a_client_of_the_launch_store():
    assert run_ranks(_store_round_trip, 2) == [b"1", b"0"]


def test_validate_refuses_a_torch_below_the_floor(monkeypatch):
    from megalite.config import ConfigError

    monkeypatch.setattr(torch, "__version__", "2.5.1")
    cfg = layout_cfg(DENSE, vocab=VOCAB, iters=ITERS)
    with pytest.raises(ConfigError, match=r"needs torch >= 2\.6; this is 2\.5\.1"):
        validate(cfg, 1)


def test_attention_backend_a_torch_lacks_is_refused_by_name(monkeypatch):
    from megalite import device

    monkeypatch.setattr(device, "has_cuda", lambda: True)
    monkeypatch.setattr(compat, "sdpa_backend", lambda name: None if name == "FLASH_ATTENTION" else name)
    err = device.attention_backend_error("flash", torch.bfloat16)
    assert err and "--attention-backend flash" in err and "FLASH_ATTENTION" in err
    assert device.attention_backend_error("auto", torch.bfloat16) is None
    assert device.attention_backend_error("fused", torch.bfloat16) is None
