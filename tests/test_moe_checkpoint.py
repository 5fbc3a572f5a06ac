"""Promises of checkpoints of mixture-of-experts models (docs/checkpoints.md, "Routed experts"):
- a run saved at EP2 x DP2 (distributed optimizer, aux loss, sigmoid router with expert bias) continues
  the uninterrupted run's loss curve (1e-5 relative) when resumed at EP4, at EP1 in one process, at
  TP2 x EP2 with sequence parallelism and at PP2 x EP2: every EP rank's experts, their expert-DP-sharded
  optimizer state and the router's expert bias are saved and restored; each pipeline stage saves its own;
- the same through pretrain_gpt.py: torchrun EP2 saves, one process resumes;
- with ZeRO-3 (experts sharded over expert-DP, dense weights over DP) a run loads that checkpoint and
  continues the curve, and its own save holds the same tensors and resumes at EP4 without sharding;
- an offline reshard to another EP / expert-TP / PP layout holds the same full tensors (weights and
  optimizer state) and resumes on the same curve;
- dense checkpoints keep their files (no expert folders), and mismatched MoE flags are refused by name;
- tasks/main.py and tools/generate.py load an MoE checkpoint and run it (eval mode); at TP=2 the
  perplexity is the single-process one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megalite.checkpointing import CheckpointMismatch
from megalite.checkpointing.full_reader import FullCheckpoint
from megalite.checkpointing.metadata import OPTIM_FIELDS
from megalite.checkpointing.paths import iter_dirname
from megalite.checkpointing.reshard import reshard
from megalite.config import validate
from megalite.config.arguments import MegaliteConfig
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.training.loop import pretrain
from tests.asserts import assert_rel_close
from tests.cli_utils import ROOT, launch_pretrain, load_tool, losses
from tests.harness import run_ranks
from tests.tp_utils import LLAMA_GQA, mock_data

VOCAB = 300
MODEL = {**LLAMA_GQA, "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
         "seq_length": 32, "max_position_embeddings": 32, "num_experts": 4, "moe_router_topk": 2,
         "moe_ffn_hidden_size": 16, "moe_aux_loss_coeff": 0.01, "moe_router_score_function": "sigmoid",
         "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.01}
ITERS, SAVED_AT = 6, 3
QUIET = lambda s: None  # noqa: E731

# name -> (world, tp, pp, ep, etp, extra flags)
LAYOUTS = {
    "ep2_dp2_distopt": (4, 1, 1, 2, None, {"use_distributed_optimizer": True}),
    "ep4": (4, 1, 1, 4, None, {}),
    "ep1_serial": (1, 1, 1, 1, None, {}),
    "tp2_ep2_sp": (4, 2, 1, 2, None, {"sequence_parallel": True, "use_distributed_optimizer": True}),
    "pp2_ep2_distopt": (4, 1, 2, 2, None, {"use_distributed_optimizer": True}),  # also saves, per stage
    "ep2_etp2": (4, 1, 1, 2, 2, {}),  # loads the offline reshard (EP2 x expert-TP 2)
    # ZeRO-3: expert weights and state sharded over expert-DP 2, dense ones over DP 4
    "ep2_zero3": (4, 1, 1, 2, None, {"data_parallel_sharding_strategy": "optim_grads_params"}),
}


def _run(rank: int, name: str, **kw) -> list[float] | None:
    world, tp, pp, ep, etp, extra = LAYOUTS[name]
    if rank >= world:
        return None
    cfg = MegaliteConfig.from_flat(dict(
        MODEL, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        micro_batch_size=1, global_batch_size=4, train_iters=ITERS, lr=3e-3, lr_warmup_iters=1, log_interval=1,
        eval_iters=0, eval_interval=1000, mock_data=True, vocab_size=VOCAB, seed=1234, **extra, **kw))
    validate(cfg, world)
    pg = ProcessGroups.single() if world == 1 else ProcessGroups.build(RankLayout(world, tp, pp, ep=ep, etp=etp), rank)
    data = mock_data(VOCAB, MODEL["seq_length"], 1234, 40 * 4)
    return pretrain(cfg, pg, data=data, log=QUIET).losses


def _runs(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    src, offline = os.path.join(root, "src"), os.path.join(root, "offline")
    out = {"straight": _run(rank, "ep2_dp2_distopt")}
    _run(rank, "ep2_dp2_distopt", exit_interval=SAVED_AT, save=src)
    out["resumed"] = _run(rank, "ep2_dp2_distopt", load=src, save=os.path.join(root, "again"))
    for name in ("ep4", "ep1_serial", "tp2_ep2_sp"):
        out[name] = _run(rank, name, load=src)
    out["pp2_ep2_distopt"] = _run(rank, "pp2_ep2_distopt", load=src, save=os.path.join(root, "pp2"))
    if rank == 0:  # offline, as tools/convert_checkpoint.py reshard does
        reshard(src, offline, tp=1, pp=2, ep=2, etp=2)
    dist.barrier()
    out["offline"] = _run(rank, "ep2_etp2", load=offline)
    zero3 = os.path.join(root, "zero3")
    out["zero3_loaded"] = _run(rank, "ep2_zero3", load=src)
    _run(rank, "ep2_zero3", exit_interval=SAVED_AT, save=zero3)
    out["from_zero3_ep4"] = _run(rank, "ep4", load=zero3)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("moe_ckpt"))
    results = run_ranks(_runs, 4, root, timeout=600)
    return {"root": root, "ranks": results, "src": os.path.join(root, "src"),
            "offline": os.path.join(root, "offline")}


def test_resume_at_the_saving_layout_is_exact(runs):
    r = runs["ranks"][0]
    assert len(r["straight"]) == ITERS and r["resumed"] == r["straight"][SAVED_AT:]


@pytest.mark.parametrize("name", ["ep4", "ep1_serial", "tp2_ep2_sp", "pp2_ep2_distopt", "offline"])
def test_resume_at_another_expert_layout_continues_the_curve(runs, name):
    r = runs["ranks"][0]
    assert len(r[name]) == ITERS - SAVED_AT
    assert_rel_close(r[name], r["straight"][SAVED_AT:], 1e-5, f"resumed at {name}")


def test_zero3_loads_saves_and_reshards_on_the_curve(runs):
    """MoE with ZeRO-3 (--data-parallel-sharding-strategy optim_grads_params) resumes a distributed
    optimizer's checkpoint on the curve; its own save holds the distributed optimizer run's full tensors,
    its expert state in one file per expert-DP rank, and resumes at EP4 without sharding on the curve."""
    r = runs["ranks"][0]
    for name in ("zero3_loaded", "from_zero3_ep4"):
        assert_rel_close(r[name], r["straight"][SAVED_AT:], 1e-5, name)
    zero3 = os.path.join(runs["root"], "zero3")
    it = os.path.join(zero3, iter_dirname(SAVED_AT))
    for ep in range(2):
        files = sorted(os.listdir(os.path.join(it, f"expert_rank_00_{ep:03d}_000")))
        assert files == ["model.safetensors", "optim_dp_000.safetensors", "optim_dp_001.safetensors"], files
    assert len(os.listdir(os.path.join(it, "mp_rank_00_000"))) == 1 + 4  # dense state over DP 4
    a, b = FullCheckpoint(zero3), FullCheckpoint(runs["src"])
    assert sorted(a.keys()) == sorted(b.keys())
    for key in a.keys():
        torch.testing.assert_close(a.param(key), b.param(key), rtol=1e-5, atol=1e-6, msg=key)
        if not key.endswith("expert_bias"):
            torch.testing.assert_close(a.optim(key, "exp_avg_sq"), b.optim(key, "exp_avg_sq"), rtol=1e-4,
                                       atol=1e-12, msg=key)


def test_every_ep_ranks_experts_and_their_sharded_optimizer_state_are_stored(runs):
    it = os.path.join(runs["src"], iter_dirname(SAVED_AT))
    meta = json.load(open(os.path.join(it, "metadata.json")))
    assert (meta["layout"]["ep"], meta["layout"]["etp"], meta["layout"]["dp"]) == (2, 1, 4)
    for ep in range(2):  # expert-DP is 2: one optimizer file per expert-DP rank with the distributed optimizer
        files = sorted(os.listdir(os.path.join(it, f"expert_rank_00_{ep:03d}_000")))
        assert files == ["model.safetensors", "optim_dp_000.safetensors", "optim_dp_001.safetensors"], files
    ckpt = FullCheckpoint(runs["src"])
    w = ckpt.param("layers.0.mlp.experts.fc1_weight")
    assert w.shape == (4, 32, 32)  # [E, 2F (SwiGLU), h], all four experts
    assert all(w[e].abs().sum() > 0 for e in range(4)), "an EP rank's experts were lost"
    assert ckpt.optim("layers.1.mlp.experts.fc2_weight", "exp_avg").shape == (4, 32, 16)
    bias = ckpt.param("layers.0.mlp.router.expert_bias")
    assert bias.abs().sum() > 0, "the expert bias was updated during training and must be saved"


def test_a_pipeline_stage_saves_its_own_experts(runs):
    """The PP2 x EP2 run's save (iteration 6) has every stage's expert folders, and its full tensors are
    the EP2 x DP2 run's at iteration 6 (same training, other layout)."""
    pp2, again = os.path.join(runs["root"], "pp2"), os.path.join(runs["root"], "again")
    it = os.path.join(pp2, iter_dirname(ITERS))
    assert sorted(d for d in os.listdir(it) if d.startswith("expert_rank")) == [
        "expert_rank_00_000_000", "expert_rank_00_000_001", "expert_rank_00_001_000", "expert_rank_00_001_001"]
    a, b = FullCheckpoint(pp2), FullCheckpoint(again)
    assert a.iteration == b.iteration == ITERS and sorted(a.keys()) == sorted(b.keys())
    for key in a.keys():
        torch.testing.assert_close(a.param(key), b.param(key), rtol=1e-5, atol=1e-6, msg=key)


def test_offline_reshard_holds_the_same_full_tensors(runs):
    src, out = FullCheckpoint(runs["src"]), FullCheckpoint(runs["offline"])
    assert (out.layout["ep"], out.layout["etp"], out.layout["pp"]) == (2, 2, 2)
    assert sorted(src.keys()) == sorted(out.keys())
    for key in src.keys():
        assert torch.equal(src.param(key), out.param(key)), key
        for f in OPTIM_FIELDS:
            if not key.endswith("expert_bias"):  # not trained by the optimizer
                assert torch.equal(src.optim(key, f), out.optim(key, f)), (key, f)
    it = os.path.join(runs["offline"], iter_dirname(SAVED_AT))
    assert sorted(d for d in os.listdir(it) if d.startswith("expert_rank")) == sorted(
        f"expert_rank_{t:02d}_{e:03d}_{p:03d}" for t in range(2) for e in range(2) for p in range(2))


def test_reshard_to_an_impossible_expert_layout_is_refused(runs, tmp_path):
    with pytest.raises(ValueError, match=r"--expert-model-parallel-size \(3\) must divide --num-experts \(4\)"):
        reshard(runs["src"], str(tmp_path / "bad"), tp=1, pp=1, ep=3)
    assert not os.path.exists(tmp_path / "bad")


def test_loading_with_other_moe_flags_is_refused_by_name(runs):
    from megalite.checkpointing.load import check_config
    from megalite.checkpointing.metadata import config_dict
    from megalite.config.model import ModelConfig

    saved = FullCheckpoint(runs["src"]).config
    for flag, value, message in (("num_experts", 8, "--num-experts: checkpoint 4, flags 8"),
                                 ("moe_router_enable_expert_bias", False,
                                  "--moe-router-enable-expert-bias: checkpoint True, flags False")):
        flags = config_dict(ModelConfig(**{**MODEL, flag: value}), VOCAB)
        with pytest.raises(CheckpointMismatch, match=message):
            check_config(saved, flags, "--load x")
    check_config(saved, config_dict(ModelConfig(**{**MODEL, "moe_router_topk": 1}), VOCAB), "--load x")


def _tool(script: str, args: list[str], nproc: int = 1) -> subprocess.CompletedProcess:
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc-per-node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*launch, str(ROOT / script), *args], capture_output=True, text=True, timeout=180,
                          cwd=ROOT, env=env)


NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1)]
TOKENS = [(7 * i) % (VOCAB - 1) for i in range(120)]


def test_generate_runs_an_moe_checkpoint(runs, capsys):
    argv = ["--load", runs["src"], *NULL_TOKENIZER, "--prompt", "5 17 2 99", "--max-new-tokens", "4", "--greedy"]
    assert load_tool("generate").main(argv) == 0
    out = capsys.readouterr().out
    assert "5 17 2 99" in out


def test_inference_loads_the_experts_and_evaluates_in_eval_mode(runs):
    from megalite.inference.evaluation import evaluate_perplexity
    from megalite.inference.loading import load_model, plan
    from megalite.moe.layer import MoELayer

    pg = ProcessGroups.single()
    chunks = load_model(plan({"load": runs["src"], "tokenizer_type": "NullTokenizer", "vocab_size": VOCAB - 1}, 1),
                        pg)
    layers = [m for m in chunks[0].modules() if isinstance(m, MoELayer)]
    assert len(layers) == 2 and not any(m.training for m in layers)
    ckpt = FullCheckpoint(runs["src"])
    for key in ("layers.1.mlp.experts.fc2_weight", "layers.1.mlp.router.expert_bias"):
        assert torch.equal(chunks[0].get_parameter(key), ckpt.param(key)), key
    res = evaluate_perplexity(chunks, pg, TOKENS, len(TOKENS), 32, 16, 2, pad=VOCAB - 1)
    assert 1 < res.ppl < 10 * VOCAB
    assert all(m.stats.microbatches == 0 for m in layers), "evaluation must not count as training routing"
    runs["serial_ppl"] = res.ppl


def test_tasks_perplexity_of_an_moe_checkpoint_is_the_same_at_tp2(runs, tmp_path):
    """tasks/main.py under torchrun at TP=2 (each TP rank routes the whole sequence, experts cut over
    expert-TP = TP) gives the single-process perplexity of the same tokens."""
    if "serial_ppl" not in runs:
        test_inference_loads_the_experts_and_evaluates_in_eval_mode(runs)
    text = tmp_path / "valid.txt"
    text.write_text(" ".join(map(str, TOKENS)))
    out = tmp_path / "result.json"
    proc = _tool("tasks/main.py", ["--task", "WIKITEXT103", "--valid-data", str(text), "--load", runs["src"],
                                   *NULL_TOKENIZER, "--tensor-model-parallel-size", "2", "--overlapping-eval", "16",
                                   "--results-json", str(out)], nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.load(open(out))
    assert result["tp"] == 2
    assert_rel_close([result["token_ppl"]], [runs["serial_ppl"]], 1e-5, "TP=2 perplexity")


def test_reshard_command_takes_the_expert_flags(runs, tmp_path, capsys):
    tool = load_tool("convert_checkpoint")
    out = str(tmp_path / "ep4_tp2")
    assert tool.main(["reshard", "--load", runs["src"], "--save", out, "--tensor-model-parallel-size", "2",
                      "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1", "--no-optim"]) == 0
    assert "EP=4 ETP=1" in capsys.readouterr().out
    src, got = FullCheckpoint(runs["src"]), FullCheckpoint(out)
    assert (got.layout["tp"], got.layout["ep"], got.layout["etp"]) == (2, 4, 1) and not got.has_optimizer()
    for key in src.keys():
        assert torch.equal(src.param(key), got.param(key)), key
    bad = ["reshard", "--load", runs["src"], "--save", str(tmp_path / "bad"), "--expert-tensor-parallel-size", "3"]
    assert tool.main(bad) == 2
    assert "--expert-tensor-parallel-size (3) must divide the expert hidden size" in capsys.readouterr().err


def test_dense_checkpoints_keep_their_files_and_old_ones_still_load(tmp_path):
    """A dense model writes no expert folder; a checkpoint from before experts (no ep/etp in its layout)
    reads back and loads as before; EP flags for a dense model are refused."""
    from megalite.checkpointing.load import load_checkpoint
    from megalite.checkpointing.metadata import config_dict
    from megalite.checkpointing.stored import named_params
    from megalite.checkpointing.writer import write_checkpoint
    from megalite.config.model import ModelConfig
    from megalite.tensor_parallel.param_meta import param_meta
    from tests.tp_utils import build

    dense = {k: v for k, v in MODEL.items() if not k.startswith(("num_experts", "moe_"))}
    cfg = ModelConfig(**dense)
    model = build(cfg, ProcessGroups.single(), VOCAB, seed=3)
    full = {k: param_meta(p).spec.unshard([p.detach()]) for _, k, p in named_params([model])}
    path = str(tmp_path / "dense")
    write_checkpoint(path, config_dict(cfg, VOCAB), full.__getitem__, tp=2, pp=1, iteration=1)
    it = os.path.join(path, iter_dirname(1))
    assert sorted(os.listdir(it)) == ["metadata.json", "mp_rank_00_000", "mp_rank_01_000"]
    meta_path = os.path.join(it, "metadata.json")
    meta = json.load(open(meta_path))
    del meta["layout"]["ep"], meta["layout"]["etp"]
    json.dump(meta, open(meta_path, "w"))
    assert all(torch.equal(FullCheckpoint(path).param(k), v) for k, v in full.items())
    fresh = build(cfg, ProcessGroups.single(), VOCAB, seed=4)
    load_checkpoint(path, [fresh], None, ProcessGroups.single(), config_dict(cfg, VOCAB), load_optim=False)
    assert all(torch.equal(p, model.get_parameter(n)) for n, p in fresh.named_parameters())
    with pytest.raises(ValueError, match="--expert-model-parallel-size needs a model with --num-experts"):
        write_checkpoint(str(tmp_path / "d"), config_dict(cfg, VOCAB), full.__getitem__, tp=1, pp=1, ep=2)


def test_missing_expert_shard_is_named(runs, tmp_path):
    import shutil

    from megalite.checkpointing.reader import CheckpointError

    copy = str(tmp_path / "copy")
    shutil.copytree(runs["src"], copy)
    gone = os.path.join(copy, iter_dirname(SAVED_AT), "expert_rank_00_001_000", "model.safetensors")
    os.remove(gone)
    with pytest.raises(CheckpointError, match=f"checkpoint shard {gone} is missing .*EP=2, expert-TP=1"):
        FullCheckpoint(copy).param("layers.0.mlp.experts.fc1_weight")
    first = os.path.join(copy, iter_dirname(SAVED_AT), "expert_rank_00_000_000", "model.safetensors")
    os.remove(first)  # the file the reader lists the experts from: metadata.json says it must be there
    with pytest.raises(CheckpointError, match=f"checkpoint shard {first} is missing"):
        FullCheckpoint(copy)


CLI = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
       "--max-position-embeddings", "32", "--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear",
       "--swiglu", "--moe-aux-loss-coeff", "0.01", "--mock-data", "--tokenizer-type", "NullTokenizer",
       "--vocab-size", "200", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4",
       "--lr", "1e-3", "--log-interval", "1", "--seed", "1234", "--eval-iters", "0", "--hidden-dropout", "0",
       "--attention-dropout", "0"]


def test_pretrain_gpt_saved_at_ep2_resumes_in_one_process(tmp_path):
    """End to end through pretrain_gpt.py: torchrun EP2 x DP2 with the sharded optimizer saves every 2
    iterations; a single process resumed from iteration 2 follows the EP2 run's iterations 3 and 4."""
    from megalite.checkpointing.paths import TRACKER

    save = str(tmp_path / "ckpt")
    ep2 = losses(launch_pretrain([*CLI, "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
                               "--save", save, "--save-interval", "2"], nproc=2))
    with open(os.path.join(save, TRACKER), "w") as f:
        f.write("2")  # resume from the middle of the run
    resumed = losses(launch_pretrain([*CLI, "--load", save]))
    assert sorted(ep2) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    assert_rel_close([resumed[i][0] for i in (3, 4)], [ep2[i][0] for i in (3, 4)], 1e-5, "lm loss")
