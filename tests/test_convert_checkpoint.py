"""Promises of offline resharding (tools/convert_checkpoint.py reshard):
- the output holds exactly the source's full tensors (weights and Adam state) at the new layout;
- training loaded from it is bitwise the run that loads the source into that layout online, which
  continues the source layout's loss curve (rel <= 1e-5), for TP=4 with GQA groups < TP and for
  interleaved PP with a distributed optimizer;
- bad input (not a checkpoint, layouts the model cannot be cut into, --save = --load, a corrupt
  shard) fails with a message naming the flag or file, and nothing is written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from megalite.checkpointing.full_reader import FullCheckpoint
from megalite.checkpointing.metadata import OPTIM_FIELDS, config_dict
from megalite.checkpointing.paths import TRACKER
from megalite.checkpointing.writer import write_checkpoint
from megalite.config import validate
from megalite.config.arguments import MegaliteConfig
from megalite.config.model import ModelConfig
from megalite.model.gpt import GPTModel
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.param_meta import param_meta
from megalite.tensor_parallel.random import RNGTracker
from megalite.training.loop import pretrain
from tests.asserts import assert_rel_close
from tests.cli_utils import load_tool
from tests.harness import run_ranks
from tests.tp_utils import LLAMA_GQA, groups_for, mock_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "convert_checkpoint.py")
VOCAB = 300
MODEL = {**LLAMA_GQA, "num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2}
QUIET = lambda s: None  # noqa: E731
SRC = (2, 2, {})  # saved at TP=2 PP=2 on 4 ranks
# Target layouts on 4 ranks: name -> (tp, pp, layers per virtual stage, extra flags).
TARGETS = {
    "tp4_groups_lt_tp": (4, 1, None, {}),
    "pp2_vp2_dp2_distopt": (1, 2, 1, {"use_distributed_optimizer": True}),
}


convert = load_tool("convert_checkpoint").main


def make_cfg(tp=1, pp=1, iters=6, **extra) -> MegaliteConfig:
    return MegaliteConfig.from_flat(dict(
        MODEL, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, micro_batch_size=1,
        global_batch_size=4, train_iters=iters, lr=3e-3, lr_warmup_iters=2, log_interval=5, eval_iters=0,
        eval_interval=1000, mock_data=True, vocab_size=VOCAB, seed=1234, **extra))


def train(cfg: MegaliteConfig, world: int, rank: int, tp: int, pp: int):
    validate(cfg, world)
    return pretrain(cfg, groups_for(world, rank, tp=tp, pp=pp), data=mock_data(VOCAB, MODEL["seq_length"], 1234, 64),
                    log=QUIET)


def _ranks(rank: int, world: int, root: str) -> dict:
    tp, pp, extra = SRC
    src = os.path.join(root, "src")
    out = {"straight": train(make_cfg(tp, pp, **extra), world, rank, tp, pp).losses}
    train(make_cfg(tp, pp, exit_interval=3, save=src, **extra), world, rank, tp, pp)
    if rank == 0:
        for name, (ttp, tpp, k, _) in TARGETS.items():
            args = ["reshard", "--load", src, "--save", os.path.join(root, name), "--tensor-model-parallel-size",
                    str(ttp), "--pipeline-model-parallel-size", str(tpp)]
            assert convert(args + (["--num-layers-per-virtual-pipeline-stage", str(k)] if k else [])) == 0
    dist.barrier()
    for name, (ttp, tpp, k, flags) in TARGETS.items():
        kw = {**flags, "num_layers_per_virtual_pipeline_stage": k}
        out[f"{name}/online"] = train(make_cfg(ttp, tpp, load=src, **kw), world, rank, ttp, tpp).losses
        out[f"{name}/offline"] = train(make_cfg(ttp, tpp, load=os.path.join(root, name), **kw), world, rank, ttp,
                                       tpp).losses
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("reshard"))
    return root, run_ranks(_ranks, 4, root, timeout=300)


@pytest.mark.parametrize("name", TARGETS)
def test_offline_reshard_holds_the_same_full_tensors(runs, name):
    root, _ = runs
    src, dst = FullCheckpoint(os.path.join(root, "src")), FullCheckpoint(os.path.join(root, name))
    tp, pp, k, _ = TARGETS[name]
    assert (dst.layout["tp"], dst.layout["pp"], dst.layout["vp"]) == (tp, pp, 2 if k else 1)
    assert dst.iteration == src.iteration == 3 and dst.state == src.state
    assert dst.optimizer_step() == src.optimizer_step() == 3
    assert sorted(dst.keys()) == sorted(src.keys())
    for key in src.keys():
        assert torch.equal(dst.param(key), src.param(key)), key
        for field in OPTIM_FIELDS:
            assert torch.equal(dst.optim(key, field), src.optim(key, field)), (key, field)


@pytest.mark.parametrize("name", TARGETS)
def test_training_from_offline_reshard_continues_the_loss_curve(runs, name):
    _, results = runs
    last = results[-1]
    offline, online, straight = last[f"{name}/offline"], last[f"{name}/online"], last["straight"][3:]
    assert len(offline) == 3
    assert offline == online  # the same tensors loaded: bitwise the online reshard
    assert_rel_close(offline, straight, 1e-5, name)


def test_reshard_command_weights_only(runs, tmp_path):
    root, _ = runs
    out = str(tmp_path / "tp1")
    proc = subprocess.run([sys.executable, TOOL, "reshard", "--load", os.path.join(root, "src"), "--save", out,
                           "--no-optim"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert open(os.path.join(out, TRACKER)).read() == "3"
    assert sorted(os.listdir(os.path.join(out, "iter_0000003"))) == ["metadata.json", "mp_rank_00_000"]
    assert os.listdir(os.path.join(out, "iter_0000003", "mp_rank_00_000")) == ["model.safetensors"]
    meta = json.load(open(os.path.join(out, "iter_0000003", "metadata.json")))
    assert meta["layout"] == {"world_size": None, "tp": 1, "pp": 1, "dp": 1, "cp": 1, "vp": 1, "order": "tp-cp-dp-pp",
                              "distributed_optimizer": False, "ep": 1, "etp": 1, "chunk_layers": [[[0, 1, 2, 3]]]}
    assert meta["written_by"]["source_layout"]["tp"] == 2


# ---- bad input ---------------------------------------------------------------------------------


def test_reshard_errors_name_the_flag_or_file(runs, tmp_path, capsys):
    root, _ = runs
    src, out = os.path.join(root, "src"), str(tmp_path / "out")

    def fails(*args: str) -> str:
        assert convert(["reshard", *args]) == 2
        assert not os.path.exists(out)
        return capsys.readouterr().err

    assert f"--load {tmp_path}: no {TRACKER} there" in fails("--load", str(tmp_path), "--save", out)
    err = fails("--load", src, "--save", out, "--tensor-model-parallel-size", "3")
    assert "--tensor-model-parallel-size (3) must divide --num-attention-heads (4)" in err
    assert "--num-query-groups (2) and --tensor-model-parallel-size (3) must divide one another" in err
    err = fails("--load", src, "--save", out, "--pipeline-model-parallel-size", "2",
                "--num-layers-per-virtual-pipeline-stage", "3")
    assert "--num-layers (4) must be divisible by --pipeline-model-parallel-size (2) x " in err
    assert "must differ from --load" in fails("--load", src, "--save", src)
    broken = str(tmp_path / "broken")
    shutil.copytree(src, broken)
    shard = os.path.join(broken, "iter_0000003", "mp_rank_01_001", "model.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(64)
    assert "mp_rank_01_001/model.safetensors is corrupt or truncated" in fails("--load", broken, "--save", out)


def test_to_hf_rejects_a_model_without_hf_equivalent(tmp_path, capsys):
    """Written offline from random tensors: RoPE with LayerNorm is neither GPT-2 nor Llama."""
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, position_embedding_type="rope")
    meta_model = GPTModel(cfg, BuildContext(ProcessGroups.single(), RNGTracker(), device=torch.device("meta")), VOCAB)
    shapes = {n: param_meta(p).full_shape for n, p in meta_model.named_parameters()}
    ckpt = str(tmp_path / "ck")
    write_checkpoint(ckpt, config_dict(cfg, VOCAB), lambda key: torch.randn(shapes[key]), tp=2, pp=2)
    assert convert(["to-hf", "--load", ckpt, "--save", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "no Hugging Face equivalent" in err and "missing: --normalization RMSNorm, --swiglu" in err
    assert not os.path.exists(tmp_path / "hf")
