"""Promise: ``to-megatron`` carries Llama 3's RoPE scaling (``use_rope_scaling``, ``rope_scaling_factor``) and
biases on q/k/v only (``add_qkv_bias``) as Megatron-LM's arguments, and ``from-megatron`` reads them back:
a Llama 3.1-style and a Qwen2-style megalite checkpoint (random weights, saved at TP2 x PP2) exported at TP2
load in megatron-core's own GPTModel (built from the args the export saved; tests/mcore_cpu.py) with
megalite's logits (fp32, 1e-5), and import back with identical logits. RoPE scaling factors megatron-core
cannot hold (it fixes the low/high frequency factors at 1/4 and the original context at 8192) are refused.
"""

from __future__ import annotations

import os

import pytest
import torch

from megalite.checkpointing.megatron.args import config_from_args
from megalite.checkpointing.megatron.names import full_shapes
from megalite.checkpointing.megatron.safe_pickle import load_torch_file
from megalite.checkpointing.writer import write_checkpoint
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout
from tests.harness import run_ranks
from tests.test_megatron_export import assert_imports_back
from tests.test_megatron_import import TOKENS, _megalite_logits, megatron_args
from tools.convert_checkpoint import main as convert

pytest.importorskip("megatron.core")

VOCAB = 95
LLAMA = dict(hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, kv_channels=16, group_query_attention=True,
             num_query_groups=2, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             add_bias_linear=False, untie_embeddings_and_output_weights=True, padded_vocab_size=100)
# head dim 16 at base 10000: wavelengths from 6 to 19869 tokens, so with megatron-core's original context of
# 8192 one frequency is interpolated and one divided by the factor
CASES = {"llama31": megatron_args(**LLAMA, use_rope_scaling=True, rope_scaling_factor=8.0),
         "qwen2": megatron_args(**LLAMA, add_qkv_bias=True)}


def _checkpoint(folder: str, config: dict) -> None:
    g = torch.Generator().manual_seed(7)
    params = {k: 0.1 * torch.randn(shape, generator=g) + (1.0 if "norm.weight" in k else 0.0)
              for k, shape in full_shapes(config).items()}
    write_checkpoint(folder, config, params.__getitem__, tp=2, pp=2, iteration=5)


def _load_in_megatron(rank: int, world: int, root: str) -> dict:
    from tests.mcore_cpu import build_gpt, cpu_shim, logits

    cpu_shim()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    out = {}
    for name in CASES:
        it_dir = os.path.join(root, name + "_mcore", "iter_0000005")
        args = load_torch_file(os.path.join(it_dir, "common.pt"))["args"]
        model = build_gpt(args, tp=2)
        model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, it_dir)["model"])
        got = logits(model, TOKENS, args.hidden_size)  # every TP rank runs the forward
        out[name] = (got if rank == 0 else None, vars(args))
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("families"))
    for name, args in CASES.items():
        _checkpoint(os.path.join(root, name), config_from_args(args, VOCAB, name))
        assert convert(["to-megatron", "--load", os.path.join(root, name), "--save",
                        os.path.join(root, name + "_mcore"), "--tensor-model-parallel-size", "2"]) == 0
    return root, run_ranks(_load_in_megatron, 2, root, timeout=300)[0]


def _pg() -> ProcessGroups:
    return ProcessGroups.unconnected(RankLayout(1, 1, 1), 0)


@pytest.mark.parametrize("name", CASES)
def test_megatron_core_at_tp2_gives_megalites_logits(exported, name):
    root, got = exported
    logits, args = got[name]
    if name == "llama31":
        assert args["use_rope_scaling"] is True and args["rope_scaling_factor"] == 8.0
    else:
        assert args["add_qkv_bias"] is True and args["add_bias_linear"] is False
    want = _megalite_logits(os.path.join(root, name), _pg())
    torch.testing.assert_close(logits[..., :VOCAB], want, rtol=0, atol=1e-5)


def test_the_scaling_changes_these_logits(exported, tmp_path):
    """The comparison above could not pass with the scaling dropped on either side."""
    root, got = exported
    config = config_from_args(CASES["llama31"], VOCAB, "llama31")
    _checkpoint(str(tmp_path / "plain"), {**config, "use_rope_scaling": False})
    plain = _megalite_logits(str(tmp_path / "plain"), _pg())
    assert (plain - got["llama31"][0][..., :VOCAB]).abs().max() > 1e-3


@pytest.mark.parametrize("name", CASES)
def test_the_export_imports_back_with_the_same_logits(exported, name, tmp_path):
    root, _ = exported
    assert_imports_back(os.path.join(root, name + "_mcore"), os.path.join(root, name), str(tmp_path / "back"))


@pytest.mark.parametrize("field, value", [("rope_scaling_low_freq_factor", 2.0),
                                          ("rope_scaling_original_max_position_embeddings", 4096)])
def test_scaling_factors_megatron_core_fixes_otherwise_are_refused(exported, tmp_path, capsys, field, value):
    root, _ = exported
    config = {**config_from_args(CASES["llama31"], VOCAB, "llama31"), field: value}
    _checkpoint(str(tmp_path / "ck"), config)
    assert convert(["to-megatron", "--load", str(tmp_path / "ck"), "--save", str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err
    assert f"--use-rope-scaling with --{field.replace('_', '-')} {value}" in err and "megatron-core" in err, err
    assert not os.path.exists(tmp_path / "out")


def test_megatron_args_with_rope_scaling_import_with_megatron_cores_fixed_factors():
    config = config_from_args(CASES["llama31"], VOCAB, "llama31")
    assert config["use_rope_scaling"] and config["rope_scaling_factor"] == 8.0
    assert (config["rope_scaling_low_freq_factor"], config["rope_scaling_high_freq_factor"],
            config["rope_scaling_original_max_position_embeddings"]) == (1.0, 4.0, 8192)
