"""--optimizer-cpu-offload / --optimizer-offload-fraction on every device (here: CPU only, where the
offloaded part still lives in its own host pool and is copied in and out explicitly):
- 10 iterations equal the run without offload at 1e-6 (fp32 and bf16; fractions 1 and 0.5), and with the
  distributed optimizer at DP 2;
- the pool holds exactly the offloaded elements (16 bytes each), the device part the rest;
- a checkpoint saves the offloaded state and a resumed run continues the straight curve exactly, also
  into a run without offload."""

from __future__ import annotations

import os

import pytest

from megalite import device
from megalite.config import ConfigError, validate
from megalite.config.arguments import MegaliteConfig
from megalite.optimizer.offload import HostPool, offloaded_count
from megalite.training.loop import pretrain
from tests.asserts import assert_rel_close
from tests.harness import run_ranks
from tests.tp_utils import LLAMA_GQA, groups_for, mock_data

VOCAB = 300
ITERS = 10
MODEL = {**LLAMA_GQA, "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2}
QUIET = lambda s: None  # noqa: E731


def make_cfg(iters: int = ITERS, **extra) -> MegaliteConfig:
    return MegaliteConfig.from_flat(dict(
        MODEL, micro_batch_size=1, global_batch_size=4, train_iters=iters, lr=3e-3, lr_warmup_iters=2,
        log_interval=5, eval_iters=0, eval_interval=1000, mock_data=True, vocab_size=VOCAB, seed=1234, **extra))


def train(cfg: MegaliteConfig, world: int = 1, rank: int = 0):
    validate(cfg, world)
    data = mock_data(VOCAB, MODEL["seq_length"], 1234, 40 * 4)
    return pretrain(cfg, groups_for(world, rank), data=data, log=QUIET)


def _curves(res) -> tuple[list[float], list[float]]:
    return res.losses, res.grad_norms


@pytest.mark.parametrize("precision", [{}, {"bf16": True}], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_offload_equals_device_run(precision, fraction):
    ref = train(make_cfg(**precision))
    off = train(make_cfg(**precision, optimizer_cpu_offload=True, optimizer_offload_fraction=fraction))
    for got, want, name in zip(_curves(off), _curves(ref), ("loss", "grad norm")):
        assert_rel_close(got, want, 1e-6, f"offload {fraction} {name}")
    mem, total = off.optimizer.memory_bytes(), off.optimizer.memory_bytes()["elements"]
    assert mem["host_pool"] == 16 * mem["host_elements"]  # main, grad staging, two moments: fp32 each
    assert 0 < mem["host_elements"] <= total and (fraction < 1) == (mem["host_elements"] < total)
    moments_on_device = 8 * (total - mem["host_elements"])
    main_on_device = 4 * (total - mem["host_elements"]) if precision else 0  # fp32 weights are the mains
    assert mem["device"] == moments_on_device + main_on_device
    # the pool is its own storage: no offloaded main param aliases a weight
    weights = {p.untyped_storage().data_ptr() for p in off.chunks[0].parameters()}
    assert all(e.main.untyped_storage().data_ptr() not in weights for e in off.optimizer.entries if e.host)


def _distributed(rank: int, world: int) -> dict:
    ref = train(make_cfg(use_distributed_optimizer=True), world, rank)
    off = train(make_cfg(use_distributed_optimizer=True, optimizer_cpu_offload=True), world, rank)
    return {"ref": _curves(ref), "off": _curves(off), "mem": off.optimizer.memory_bytes()}


def test_offload_with_distributed_optimizer_dp2():
    for rank, out in enumerate(run_ranks(_distributed, 2)):
        for got, want, name in zip(out["off"], out["ref"], ("loss", "grad norm")):
            assert_rel_close(got, want, 1e-6, f"rank {rank} {name}")
        assert out["mem"]["host_elements"] == out["mem"]["elements"] > 0  # each rank offloads its own shard


def test_checkpoint_saves_and_loads_offloaded_state(tmp_path):
    straight = train(make_cfg(iters=8, optimizer_cpu_offload=True)).losses
    save = str(tmp_path / "ckpt")
    train(make_cfg(iters=8, optimizer_cpu_offload=True, exit_interval=4, save=save))
    resumed = train(make_cfg(iters=8, optimizer_cpu_offload=True, load=save))
    assert resumed.losses == straight[4:]  # bitwise: main params and both moments came back from the pool
    assert os.path.isdir(save)
    on_device = train(make_cfg(iters=8, load=save)).losses  # the offloaded state loads without offload too
    assert_rel_close(on_device, straight[4:], 1e-6, "resumed without offload")


def test_pool_and_fraction_split():
    pool = HostPool(10)
    a, b = pool.take(4), pool.take(6)
    assert a["main"].numel() == 4 and b["exp_avg_sq"].numel() == 6 and pool.nbytes == 160
    a["grad"].fill_(1.0)
    assert pool.data.sum() == 4 and not b["grad"].any()
    with pytest.raises(ValueError):
        pool.take(1)
    assert [offloaded_count([4, 4, 2], f) for f in (0.0, 0.3, 0.5, 0.81, 1.0)] == [0, 1, 2, 3, 3]
    assert pool.pinned == device.pin_memory_supported()  # pinned wherever the build can pin


@pytest.mark.parametrize("extra, fragment", [
    ({"optimizer_offload_fraction": 0.5}, "--optimizer-offload-fraction needs --optimizer-cpu-offload"),
    ({"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.5},
         "--optimizer-offload-fraction must be a finite number in (0, 1]"),
])
def test_bad_offload_flags_are_named(extra, fragment):
    with pytest.raises(ConfigError) as e:
        validate(make_cfg(**extra), 1)
    assert fragment in str(e.value)
