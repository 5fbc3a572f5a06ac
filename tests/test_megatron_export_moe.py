"""Promise (docs/checkpoints.md, "Export"): ``convert_checkpoint.py to-megatron`` exports MoE models too, in
both formats, and megatron-core's own GPTModel (local spec, SequentialMLP experts) loads them and computes
megalite's logits.

The reference is megatron-core on the CPU over gloo (tests/mcore_cpu.py). Three megalite MoE checkpoints are
written at TP2 x PP2 with random weights: Mixtral-style (4 experts, top-2, GQA, SwiGLU, RoPE), one with
a shared expert and a sigmoid router with expert bias, and one mixing an MoE and a dense layer
(--moe-layer-freq [1,0], keyed per layer in torch_dist). Each is exported as torch_dist (loaded at TP2 by
``dist_checkpointing.load``), as the legacy format cut for TP2 (each rank's file loaded strictly at TP2) and
for EP2 (``mp_rank_00_00E``, each EP rank's file loaded strictly at EP2); megatron-core's logits must equal
megalite's at TP1 (fp32, 1e-5), and every export imports back with ``from-megatron`` to the same logits.
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
from tests.test_megatron_import import CASES, TOKENS, _megalite_logits, megatron_args
from tools.convert_checkpoint import main as convert

pytest.importorskip("megatron.core")

VOCAB = 95
MOE = {"mixtral": CASES["mixtral"],
       "shared": megatron_args(**{**vars(CASES["mixtral"]), "moe_shared_expert_intermediate_size": 24,
                                  "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}),
       "mixed": megatron_args(**{**vars(CASES["mixtral"]), "moe_layer_freq": [1, 0]})}  # an MoE, a dense layer
EXPORTS = {"_mcore": ["--tensor-model-parallel-size", "2"],
           "_legacy": ["--format", "torch", "--tensor-model-parallel-size", "2"],
           "_legacy_ep2": ["--format", "torch", "--expert-model-parallel-size", "2"]}


def _checkpoint(folder: str, args, name: str, **override) -> None:
    """A megalite checkpoint of ``args``' model (config fields ``override``) at TP2 x PP2, every tensor
    random (norms around 1)."""
    config = {**config_from_args(args, VOCAB, name), **override}
    g = torch.Generator().manual_seed(11)
    params = {k: 0.1 * torch.randn(shape, generator=g) + (1.0 if "norm.weight" in k else 0.0)
              for k, shape in full_shapes(config).items()}
    write_checkpoint(folder, config, params.__getitem__, tp=2, pp=2, iteration=5)


def _load(model, path: str) -> dict:
    saved = load_torch_file(path)
    model.load_state_dict(saved["model"], strict=True)
    return saved


def _load_in_megatron(rank: int, world: int, root: str) -> dict:
    """Each export loaded by megatron-core at the layout it was made for; logits from rank 0."""
    from tests.mcore_cpu import build_gpt, cpu_shim, logits

    cpu_shim()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    out = {}
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    for name in MOE:
        it_dir = os.path.join(root, name + "_mcore", "iter_0000005")
        args = load_torch_file(os.path.join(it_dir, "common.pt"))["args"]
        model = build_gpt(args, tp=2)
        model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, it_dir)["model"])
        out[name + "_mcore"] = logits(model, TOKENS, args.hidden_size)
        path = os.path.join(root, name + "_legacy", "iter_0000005", f"mp_rank_{rank:02d}", "model_optim_rng.pt")
        saved = load_torch_file(path)
        model = build_gpt(saved["args"], tp=2)
        _load(model, path)
        out[name + "_legacy"] = logits(model, TOKENS, args.hidden_size)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=2)
    for name in MOE:
        path = os.path.join(root, name + "_legacy_ep2", "iter_0000005", f"mp_rank_00_{rank:03d}", "model_optim_rng.pt")
        saved = load_torch_file(path)
        assert saved["args"].expert_model_parallel_size == 2
        model = build_gpt(saved["args"], tp=1)
        _load(model, path)
        out[name + "_legacy_ep2"] = logits(model, TOKENS, saved["args"].hidden_size)
    ps.destroy_model_parallel()
    return out if rank == 0 else {}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("export_moe"))
    for name, args in MOE.items():
        _checkpoint(os.path.join(root, name), args, name)
        for suffix, flags in EXPORTS.items():
            assert convert(["to-megatron", "--load", os.path.join(root, name), "--save",
                            os.path.join(root, name + suffix), *flags]) == 0
    ranks = run_ranks(_load_in_megatron, 2, root, timeout=180)
    return root, ranks[0]


@pytest.mark.parametrize("fmt", list(EXPORTS))
@pytest.mark.parametrize("name", list(MOE))
def test_megatron_core_loads_the_moe_export_and_gives_megalite_logits(exported, name, fmt):
    root, got = exported
    want = _megalite_logits(os.path.join(root, name), ProcessGroups.unconnected(RankLayout(1, 1, 1), 0))
    torch.testing.assert_close(got[name + fmt][..., :VOCAB], want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fmt", list(EXPORTS))
@pytest.mark.parametrize("name", list(MOE))
def test_the_moe_export_imports_back_with_the_same_logits(exported, name, fmt, tmp_path):
    """from-megatron of each export (the EP2 cut's ``mp_rank_00_00E`` names read as EP ranks, PP being 1)."""
    root, _ = exported
    assert_imports_back(os.path.join(root, name + fmt), os.path.join(root, name), str(tmp_path / "back"))


def test_mixed_dense_and_moe_layers_export_per_layer_in_torch_dist(exported):
    """--moe-layer-freq [1,0]: torch_dist keys each layer apart under its global number (as megatron-core
    keys non-homogeneous layers; megatron-core loaded it above), the dense layer with no expert keys; the
    legacy TP2 x PP2 cut imports back to the same logits."""
    from megalite.checkpointing.megatron.torch_dist.reader import DistCheckpoint

    root, _ = exported
    keys = DistCheckpoint(os.path.join(root, "mixed_mcore", "iter_0000005")).keys()
    assert "decoder.layers.0.mlp.experts.experts.linear_fc1.weight" in keys
    assert "decoder.layers.1.mlp.linear_fc1.weight" in keys and not any("layers.1.mlp.experts" in k for k in keys)
    assert not any(k.startswith("decoder.layers.") and not k.split(".")[2].isdigit() for k in keys)
    cut, back = (os.path.join(root, n) for n in ("mixed_tp2pp2", "mixed_back"))
    assert convert(["to-megatron", "--load", os.path.join(root, "mixed"), "--save", cut, "--format", "torch",
                    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]) == 0
    assert convert(["from-megatron", "--load", cut, "--save", back]) == 0
    pg = ProcessGroups.unconnected(RankLayout(1, 1, 1), 0)
    torch.testing.assert_close(_megalite_logits(back, pg), _megalite_logits(os.path.join(root, "mixed"), pg),
                               rtol=0, atol=0)


def test_bad_expert_layouts_are_refused_by_name(exported, tmp_path, capsys):
    root, _ = exported
    src = os.path.join(root, "mixtral")
    for flags, message in (
            (["--format", "torch", "--expert-model-parallel-size", "3"],
             "--expert-model-parallel-size (3) must divide the routed experts (4)"),
            (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size: a torch_dist export holds whole")):
        assert convert(["to-megatron", "--load", src, "--save", str(tmp_path / "o"), *flags]) == 2
        assert message in capsys.readouterr().err
        assert not os.path.exists(tmp_path / "o")
    gated = str(tmp_path / "gated")
    _checkpoint(gated, MOE["shared"], "shared", moe_shared_expert_gate=True)
    assert convert(["to-megatron", "--load", gated, "--save", str(tmp_path / "o")]) == 2
    assert "--moe-shared-expert-gate is not exported" in capsys.readouterr().err
