"""Promise (docs/checkpoints.md, "Megatron-LM checkpoints"): a checkpoint megatron-core saved (torch_dist,
local layer spec) imports into megalite at any layout and computes megatron-core's logits.

The reference is megatron-core itself (pip package, tests only), run on the CPU over gloo with the shim of
tests/mcore_cpu.py: a GPT-2-style and a Llama-style model (GQA, SwiGLU, RoPE, untied), a Mixtral-style MoE
and one mixing MoE and dense layers (--moe-layer-freq, keyed per layer in torch_dist) are built at TP2 x PP2,
every parameter perturbed, saved with ``dist_checkpointing.save`` as Megatron-LM's training loop does
(model state, ``args``, iteration, tracker), and their logits recorded. ``convert_checkpoint.py
from-megatron`` imports each folder; megalite's model loads the result at TP1 (one process) and TP2 and
must give the same logits (fp32, 1e-5).
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch
import torch.distributed as dist

from megalite.checkpointing.load import load_checkpoint
from megalite.checkpointing.megatron.safe_pickle import load_torch_file
from megalite.checkpointing.metadata import model_config
from megalite.model.gpt import GPTModel
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.random import RNGTracker
from tests.harness import run_ranks
from tools.convert_checkpoint import main as convert

pytest.importorskip("megatron.core")

TOKENS = torch.tensor([[3, 17, 42, 5, 88, 1, 64, 9, 23, 50, 7, 11], [60, 2, 33, 91, 14, 8, 0, 77, 45, 19, 6, 30]])


def megatron_args(**kw) -> argparse.Namespace:
    """The arguments Megatron-LM saves, under its own names (those the cases set; the rest default)."""
    base = dict(num_layers=2, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4, kv_channels=8,
                group_query_attention=False, num_query_groups=1, seq_length=16, max_position_embeddings=16,
                position_embedding_type="learned_absolute", rotary_base=10000, rotary_percent=1.0,
                normalization="LayerNorm", norm_epsilon=1e-5, swiglu=False, add_bias_linear=True,
                add_qkv_bias=False, untie_embeddings_and_output_weights=False, padded_vocab_size=96,
                hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=2,
                pipeline_model_parallel_size=2, consumed_train_samples=14, params_dtype=torch.float32)
    return argparse.Namespace(**{**base, **kw})


CASES = {  # saved by megatron-core at TP2 x PP2
    "gpt2": megatron_args(),
    "llama": megatron_args(ffn_hidden_size=48, group_query_attention=True, num_query_groups=2,
                           position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                           add_bias_linear=False, untie_embeddings_and_output_weights=True, padded_vocab_size=100),
}
CASES["mixtral"] = megatron_args(**{**vars(CASES["llama"]), "num_experts": 4, "moe_ffn_hidden_size": 16,
                                    "moe_router_topk": 2})
# --moe-layer-freq [1,0,0,1]: each stage of PP2 holds an MoE and a dense layer, saved per layer in torch_dist
CASES["mixed"] = megatron_args(**{**vars(CASES["mixtral"]), "num_layers": 4, "moe_layer_freq": [1, 0, 0, 1]})


def _save_and_load(rank: int, world: int, root: str) -> dict:
    """Each case built by megatron-core at TP2 x PP2 and saved in both formats (its logits from the last
    stage), then imported at TP2 by rank 0 and loaded by megalite at TP2 x DP2 (its logits from rank 0):
    one start of the ranks for all of it."""
    from tests.mcore_cpu import build_gpt, cpu_shim, logits, save_megatron, save_megatron_legacy

    cpu_shim()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    out = {}
    for name, args in CASES.items():
        model = build_gpt(args, tp=2, pp=2)
        save_megatron(model, args, os.path.join(root, name), iteration=7)
        save_megatron_legacy(model, args, os.path.join(root, name + "_legacy"), iteration=7)
        got = logits(model, TOKENS, args.hidden_size)  # every TP rank takes part in the logits' all-gather
        out[name] = got if got is not None and ps.get_tensor_model_parallel_rank() == 0 else None
    ps.destroy_model_parallel()
    if rank == 0:
        for name in FOLDERS:
            assert convert(["from-megatron", "--load", os.path.join(root, name), "--save",
                            os.path.join(root, name + "_tp2"), "--tensor-model-parallel-size", "2"]) == 0
    dist.barrier()
    pg = ProcessGroups.build(RankLayout(world, tp=2, pp=1), rank)
    for name in FOLDERS:
        got = _megalite_logits(os.path.join(root, name + "_tp2"), pg)
        out[name + "_tp2"] = got if rank == 0 else None
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("megatron"))
    ranks = run_ranks(_save_and_load, 4, root, timeout=180)
    merged = {k: next(r[k] for r in ranks if r[k] is not None) for k in ranks[0]}
    return root, merged


FOLDERS = [name + fmt for name in CASES for fmt in ("", "_legacy")]  # torch_dist, legacy torch


def _megalite_logits(load: str, pg: ProcessGroups) -> torch.Tensor:
    from megalite.checkpointing.reader import CheckpointReader

    config = CheckpointReader(load).config
    cfg, vocab = model_config(config)
    model = GPTModel(cfg, BuildContext(pg, RNGTracker()), vocab).eval()
    load_checkpoint(load, [model], None, pg, config, load_optim=False, load_rng=False)
    with torch.no_grad():
        return model(TOKENS)


def _import(saved, name: str, tmp_path, tp: int) -> str:
    root, _ = saved
    out = str(tmp_path / f"{name}_tp{tp}")
    assert convert(["from-megatron", "--load", os.path.join(root, name), "--save", out,
                    "--tensor-model-parallel-size", str(tp)]) == 0
    return out


@pytest.mark.parametrize("name", FOLDERS)
def test_megatron_core_checkpoint_gives_its_logits_at_tp1(saved, name, tmp_path):
    load = _import(saved, name, tmp_path, 1)
    got = _megalite_logits(load, ProcessGroups.unconnected(RankLayout(1, 1, 1), 0))
    want = saved[1][name.removesuffix("_legacy")]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", FOLDERS)
def test_megatron_core_checkpoint_gives_its_logits_at_tp2(saved, name):
    want = saved[1][name.removesuffix("_legacy")]
    torch.testing.assert_close(saved[1][name + "_tp2"], want, rtol=0, atol=1e-5)


def test_pretrain_loads_a_megatron_checkpoint_in_process(saved):
    """``pretrain_gpt.py --load`` of Megatron-LM's folder at TP2: weights read in-process, training continues
    from its iteration with the losses of a one-process run loading the ``from-megatron`` import (the same
    weights, a fresh optimizer); without --no-load-optim the missing optimizer state is named."""
    from megalite.checkpointing.errors import CheckpointError
    from megalite.checkpointing.megatron.load import load_megatron
    from megalite.checkpointing.megatron.read import read_megatron
    from tests.asserts import assert_rel_close
    from tests.cli_utils import launch_pretrain, losses
    from tools.convert_checkpoint import model_flags

    load = os.path.join(saved[0], "gpt2")
    flags = model_flags(read_megatron(load).config).split()
    run = ["--mock-data", "--vocab-size", "95", *flags, "--seq-length", "16", "--micro-batch-size", "2",
           "--global-batch-size", "2", "--log-interval", "1", "--train-iters", "10", "--no-load-optim",
           "--hidden-dropout", "0", "--attention-dropout", "0"]  # vocab: 95 + the end-of-document token
    direct = launch_pretrain([*run, "--load", load, "--tensor-model-parallel-size", "2"], nproc=2, timeout=150)
    assert "as a Megatron-LM checkpoint" in direct.stdout and "at iteration 7" in direct.stdout, direct.stdout[-2000:]
    imported = launch_pretrain([*run, "--load", os.path.join(saved[0], "gpt2_tp2")], timeout=150)
    got, want = losses(direct), losses(imported)
    assert sorted(got) == sorted(want) == [8, 9, 10]
    assert_rel_close([got[i][0] for i in got], [want[i][0] for i in got], 1e-5, "in-process TP2 vs imported TP1")
    with pytest.raises(CheckpointError, match="whose optimizer state does not load .*; pass --no-load-optim"):
        load_megatron(load, [], None, {}, weights_only=False)  # what maybe_load calls without the flag


# ---- bad input: every file checked before it is trusted ------------------------------------------------


def _copy(saved, name: str, tmp_path) -> str:
    import shutil

    dst = str(tmp_path / name)
    shutil.copytree(os.path.join(saved[0], name), dst)
    return dst


def _refused(load: str, tmp_path, *match: str) -> None:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = convert(["from-megatron", "--load", load, "--save", str(tmp_path / "out")])
    assert code == 2, err.getvalue()
    line = err.getvalue().strip()
    assert "Traceback" not in line and all(m in line for m in match), line
    assert not os.path.exists(tmp_path / "out")


def test_a_missing_or_truncated_distcp_file_is_named(saved, tmp_path):
    load = _copy(saved, "llama", tmp_path)
    it = os.path.join(load, "iter_0000007")
    victim = os.path.join(it, sorted(f for f in os.listdir(it) if f.endswith(".distcp"))[0])
    with open(victim, "r+b") as f:
        f.truncate(100)
    _refused(load, tmp_path, os.path.basename(victim), "truncated")
    os.remove(victim)
    _refused(load, tmp_path, os.path.basename(victim), "is missing")


def test_a_missing_legacy_rank_file_is_named(saved, tmp_path):
    load = _copy(saved, "gpt2_legacy", tmp_path)
    os.remove(os.path.join(load, "iter_0000007", "mp_rank_01_001", "model_optim_rng.pt"))
    _refused(load, tmp_path, "TP rank 1, PP rank 1", "missing")


def test_unknown_keys_wrong_shapes_and_unsupported_args_are_named(saved, tmp_path):
    load = _copy(saved, "gpt2_legacy", tmp_path)
    paths = [os.path.join(load, "iter_0000007", f"mp_rank_0{t}_000", "model_optim_rng.pt") for t in (0, 1)]
    states = [load_torch_file(p) for p in paths]  # files this test wrote
    good = [dict(s["model"]) for s in states]

    def write(edit) -> None:
        for path, state, model in zip(paths, states, good):
            state["model"] = dict(model)
            edit(state)
            torch.save(state, path)

    write(lambda s: s["model"].update({"decoder.layers.0.self_attention.linear_q_down_proj.weight": torch.ones(8)}))
    _refused(load, tmp_path, "linear_q_down_proj.weight", "not a parameter megalite knows")
    # q/k norms where the args have no --qk-layernorm: tensors the model its args describe lacks
    write(lambda s: s["model"].update({"decoder.layers.0.self_attention.q_layernorm.weight": torch.ones(8)}))
    _refused(load, tmp_path, "unexpected ['layers.0.attention.q_norm.weight']")
    write(lambda s: s["model"].update({"decoder.layers.0.mlp.linear_fc2.weight": torch.ones(32, 3)}))
    _refused(load, tmp_path, "layers.0.mlp.fc2.weight has shape (32, 6)", "needs (32, 128)")
    write(lambda s: s.update(args=argparse.Namespace(**{**vars(s["args"]), "rotary_interleaved": True})))
    _refused(load, tmp_path, "rotary_interleaved=True", "not implemented")



def test_the_runs_tokenizer_is_recorded(saved, tmp_path):
    """The args' tokenizer flags (megalite's flags of the same names) go into the import's metadata, where
    to-hf finds them."""
    from megalite.checkpointing.reader import CheckpointReader

    load = _copy(saved, "gpt2_legacy", tmp_path)
    tok = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "vocab.json", "merge_file": "merges.txt",
           "tokenizer_model": None}
    for rank_dir in os.listdir(os.path.join(load, "iter_0000007")):
        path = os.path.join(load, "iter_0000007", rank_dir, "model_optim_rng.pt")
        state = load_torch_file(path)  # a file this test wrote
        torch.save({**state, "args": argparse.Namespace(**{**vars(state["args"]), **tok})}, path)
    out = str(tmp_path / "imported")
    assert convert(["from-megatron", "--load", load, "--save", out]) == 0
    assert CheckpointReader(out).meta["tokenizer"] == tok


def test_to_hf_straight_from_a_megatron_checkpoint(saved, tmp_path):
    """to-hf reads the Megatron-LM folder itself; transformers' Llama computes megatron-core's logits."""
    from transformers import LlamaForCausalLM

    out = str(tmp_path / "hf")
    assert convert(["to-hf", "--load", os.path.join(saved[0], "llama_legacy"), "--save", out]) == 0
    hf = LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        got = hf(TOKENS).logits
    torch.testing.assert_close(got, saved[1]["llama"], rtol=0, atol=1e-4)


def test_legacy_expert_parallel_files_are_renumbered(saved, tmp_path):
    """Megatron-LM's legacy layout with EP: ``mp_rank_TT_PPP_EEE``, each EP rank's experts numbered from 0.
    Made here by splitting the TP2 x PP2 Mixtral files' four experts over two EP ranks (torch.save)."""
    import re
    import shutil

    src = os.path.join(saved[0], "mixtral_legacy", "iter_0000007")
    load = tmp_path / "ep2"
    it = load / "iter_0000007"
    for rank_dir in os.listdir(src):
        state = load_torch_file(os.path.join(src, rank_dir, "model_optim_rng.pt"))
        for e in (0, 1):
            model = {}
            for k, v in state["model"].items():
                m = re.search(r"local_experts\.(\d+)\.", k)
                if m is None:
                    model[k] = v
                elif int(m[1]) // 2 == e:
                    model[k.replace(m[0], f"local_experts.{int(m[1]) % 2}.")] = v
            (it / f"{rank_dir}_{e:03d}").mkdir(parents=True)
            torch.save({**state, "model": model}, it / f"{rank_dir}_{e:03d}" / "model_optim_rng.pt")
    shutil.copy(os.path.join(saved[0], "mixtral_legacy", "latest_checkpointed_iteration.txt"), load)
    out = str(tmp_path / "out")
    assert convert(["from-megatron", "--load", str(load), "--save", out]) == 0
    got = _megalite_logits(out, ProcessGroups.unconnected(RankLayout(1, 1, 1), 0))
    torch.testing.assert_close(got, saved[1]["mixtral"], rtol=0, atol=1e-5)


def test_legacy_transformer_engine_names_and_extra_state(saved, tmp_path):
    """A legacy state dict of the Transformer Engine spec: norms fused into the next linear
    (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``) and each module's ``_extra_state``
    a BytesIO (fp8 metadata): made here by renaming the local-spec Llama files' keys (torch.save)."""
    import io
    import shutil

    load = _copy(saved, "llama_legacy", tmp_path)
    renames = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
               "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
    it = os.path.join(load, "iter_0000007")
    for rank_dir in os.listdir(it):
        path = os.path.join(it, rank_dir, "model_optim_rng.pt")
        state = load_torch_file(path)  # a file this test wrote
        model = {}
        for k, v in state["model"].items():
            for old, new in renames.items():
                k = k.replace(old, new)
            model[k] = io.BytesIO(b"fp8 metadata") if k.endswith("_extra_state") else v
        torch.save({**state, "model": model}, path)
    out = str(tmp_path / "out")
    assert convert(["from-megatron", "--load", load, "--save", out]) == 0
    shutil.rmtree(load)
    got = _megalite_logits(out, ProcessGroups.unconnected(RankLayout(1, 1, 1), 0))
    torch.testing.assert_close(got, saved[1]["llama"], rtol=0, atol=1e-5)


def test_a_release_folder_is_read(saved, tmp_path):
    """``latest_checkpointed_iteration.txt`` holding ``release`` names ``release/`` (iteration 0 there)."""
    load = _copy(saved, "gpt2", tmp_path)
    os.rename(os.path.join(load, "iter_0000007"), os.path.join(load, "release"))
    with open(os.path.join(load, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release")
    out = str(tmp_path / "imported")
    assert convert(["from-megatron", "--load", load, "--save", out]) == 0
    got = _megalite_logits(out, ProcessGroups.unconnected(RankLayout(1, 1, 1), 0))
    torch.testing.assert_close(got, saved[1]["gpt2"], rtol=0, atol=1e-5)
    with open(os.path.join(load, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("seven")
    _refused(load, tmp_path, "latest_checkpointed_iteration.txt", "'seven'")


@pytest.mark.parametrize("name", ["gpt2", "mixtral_legacy", "mixed"])
def test_import_at_tp2_pp2_holds_the_same_full_tensors(saved, name, tmp_path):
    """The output layout is any layout: written at TP2 x PP2 (tied embedding across stages; experts cut
    over expert-TP), read back whole, every tensor equals the TP1 import's."""
    from megalite.checkpointing.full_reader import FullCheckpoint

    one = FullCheckpoint(_import(saved, name, tmp_path, 1))
    out = str(tmp_path / f"{name}_tp2pp2")
    assert convert(["from-megatron", "--load", os.path.join(saved[0], name), "--save", out,
                    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]) == 0
    cut = FullCheckpoint(out)
    assert cut.layout["tp"] == 2 and cut.layout["pp"] == 2 and cut.iteration == 7
    assert cut.state["consumed_samples"] == 14
    assert cut.keys() == one.keys()
    for key in one.keys():
        assert torch.equal(cut.param(key), one.param(key)), key
