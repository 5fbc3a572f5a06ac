"""Promises of checkpoints:
- exact resume: 8 iterations straight and 4 + resume + 4 give bitwise the same lm loss (fp32);
- resharding: a checkpoint saved in one layout continues in another on the original loss curve (the
  pipelined layouts under NCCL's point-to-point rules);
- atomic saves, and errors that name the differing flags, the missing file or the expected tracker."""

from __future__ import annotations

import os
import shutil

import pytest

from megalite.checkpointing import CheckpointMismatch
from megalite.checkpointing.paths import TRACKER, staging_dir
from megalite.checkpointing.reader import CheckpointError
from megalite.config import validate
from megalite.config.arguments import MegaliteConfig
from megalite.parallel.groups import NCCL_SEMANTICS_ENV
from megalite.training.loop import pretrain
from tests.asserts import assert_rel_close
from tests.harness import run_ranks
from tests.tp_utils import LLAMA_GQA, groups_for, mock_data

VOCAB = 300
MODEL = {**LLAMA_GQA, "num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2}
QUIET = lambda s: None  # noqa: E731


def make_cfg(tp=1, pp=1, iters=8, **extra) -> MegaliteConfig:
    return MegaliteConfig.from_flat(dict(
        MODEL, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, micro_batch_size=1,
        global_batch_size=4, train_iters=iters, lr=3e-3, lr_warmup_iters=2, log_interval=5, eval_iters=0,
        eval_interval=1000, mock_data=True, vocab_size=VOCAB, seed=1234, **extra))


def train(cfg: MegaliteConfig, world: int, rank: int, tp=1, pp=1):
    validate(cfg, world)
    data = mock_data(VOCAB, MODEL["seq_length"], 1234, 40 * 4)
    return pretrain(cfg, groups_for(world, rank, tp=tp, pp=pp), data=data, log=QUIET)


# Layouts: name -> (tp, pp, extra flags), on 4 ranks (or 1 for "serial").
LAYOUTS = {
    "serial": (1, 1, {}),
    "tp2_dp2_distopt": (2, 1, {"use_distributed_optimizer": True}),
    "pp2_dp2": (1, 2, {}),
    "tp2_pp2": (2, 2, {}),
    "dp4_distopt": (1, 1, {"use_distributed_optimizer": True}),
}


def _layout_run(rank, world, name, **kw):
    tp, pp, extra = LAYOUTS[name]
    n = 1 if name == "serial" else world
    if n == 1 and rank != 0:
        return None
    cfg = make_cfg(tp, pp, **extra, **kw)
    os.environ[NCCL_SEMANTICS_ENV] = "1" if pp > 1 else "0"  # pipelines under NCCL's point-to-point rules
    return train(cfg, n, rank if n > 1 else 0, tp, pp).losses


def _resume_and_reshard(rank: int, world: int, root: str) -> dict:
    out = {}
    src = os.path.join(root, "src")
    # The source layout: 8 straight, and 4 saved then resumed for 4 more.
    out["straight"] = _layout_run(rank, world, "tp2_dp2_distopt")
    _layout_run(rank, world, "tp2_dp2_distopt", exit_interval=4, save=src)
    out["resumed"] = _layout_run(rank, world, "tp2_dp2_distopt", load=src, save=os.path.join(root, "again"))
    for name in ("serial", "pp2_dp2", "tp2_pp2", "dp4_distopt"):
        out[name] = _layout_run(rank, world, name, load=src)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return run_ranks(_resume_and_reshard, 4, str(tmp_path_factory.mktemp("ckpt")), timeout=400)


def test_resume_is_bitwise_exact(runs):
    for rank, r in enumerate(runs):
        assert len(r["resumed"]) == 4
        assert r["resumed"] == r["straight"][4:], f"rank {rank}"


@pytest.mark.parametrize("layout", ["serial", "pp2_dp2", "tp2_pp2", "dp4_distopt"])
def test_reshard_continues_the_loss_curve(runs, layout):
    want = runs[0]["straight"][4:]
    got = runs[0][layout] if layout == "serial" else runs[3][layout]
    assert len(got) == 4
    assert_rel_close(got, want, 1e-5, layout)


# ---- single-process checks of files and errors ------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("single") / "ck")
    train(make_cfg(iters=4, save=d, save_interval=2), 1, 0)
    return d


def test_layout_is_documented_and_tracker_points_at_last(saved):
    assert open(os.path.join(saved, TRACKER)).read() == "4"
    assert set(os.listdir(saved)) == {TRACKER, "iter_0000002", "iter_0000004"}
    files = sorted(os.listdir(os.path.join(saved, "iter_0000004")))
    assert files == ["metadata.json", "mp_rank_00_000", "rng"]
    assert sorted(os.listdir(os.path.join(saved, "iter_0000004", "mp_rank_00_000"))) == [
        "model.safetensors", "optim_dp_000.safetensors"]


def test_interrupted_save_leaves_previous_checkpoint_loadable(saved, tmp_path):
    d = str(tmp_path / "ck")
    shutil.copytree(saved, d)
    # A save of iteration 6 that died half-way: its staging directory holds some files, no commit.
    staged = staging_dir(d, 6)
    shutil.copytree(os.path.join(d, "iter_0000004"), staged)
    os.remove(os.path.join(staged, "metadata.json"))
    res = train(make_cfg(iters=5, load=d), 1, 0)
    assert len(res.losses) == 1  # resumed from 4, not from the broken 6
    train(make_cfg(iters=6, load=d, save=d), 1, 0)  # a later save replaces the leftovers
    assert open(os.path.join(d, TRACKER)).read() == "6" and not os.path.exists(staged)


def test_config_mismatch_names_each_differing_flag(saved):
    cfg = make_cfg(iters=6, load=saved)
    cfg.model.hidden_size, cfg.model.swiglu = 64, False
    cfg.model.__post_init__()
    with pytest.raises(CheckpointMismatch) as err:
        train(cfg, 1, 0)
    msg = str(err.value)
    assert "--hidden-size: checkpoint 32, flags 64" in msg and "--swiglu: checkpoint True, flags False" in msg


def test_missing_shard_names_the_file(saved, tmp_path):
    d = str(tmp_path / "ck")
    shutil.copytree(saved, d)
    os.remove(os.path.join(d, "iter_0000004", "mp_rank_00_000", "model.safetensors"))
    with pytest.raises(CheckpointError, match="mp_rank_00_000/model.safetensors is missing"):
        train(make_cfg(iters=6, load=d), 1, 0)


def test_corrupt_shard_names_the_file(saved, tmp_path):
    d = str(tmp_path / "ck")
    shutil.copytree(saved, d)
    path = os.path.join(d, "iter_0000004", "mp_rank_00_000", "optim_dp_000.safetensors")
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match="optim_dp_000.safetensors is corrupt or truncated"):
        train(make_cfg(iters=6, load=d), 1, 0)


def test_missing_tracker_says_what_was_expected(tmp_path):
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=f"no {TRACKER} there; expected a checkpoint directory"):
        train(make_cfg(iters=2, load=str(tmp_path / "empty")), 1, 0)


def test_finetune_and_no_load_optim_load_weights_only(saved):
    res = train(make_cfg(iters=2, load=saved, finetune=True), 1, 0)
    assert len(res.losses) == 2  # starts again at iteration 0
    res = train(make_cfg(iters=6, load=saved, no_load_optim=True), 1, 0)
    assert len(res.losses) == 2
