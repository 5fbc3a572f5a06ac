"""Promise (docs/checkpoints.md, "Megatron-LM checkpoints"): ``convert_checkpoint.py to-megatron`` writes a
torch_dist folder that megatron-core's own ``dist_checkpointing.load`` reads into its GPTModel at a TP of
its choice, which then computes megalite's logits.

The reference is megatron-core (pip package, tests only) on the CPU over gloo (tests/mcore_cpu.py). A
GPT-2-style and a Llama-style (GQA, SwiGLU, RoPE, untied) megalite checkpoint are written at TP2 x PP2 with
random weights, exported, and loaded by a megatron-core GPTModel at TP2 built from the ``args`` the export
saved in common.pt; its logits must equal megalite's own at TP1 (fp32, 1e-5). The legacy ``--format torch``
export cut for TP2 loads the same way, each rank's file with ``load_state_dict(strict=True)``.
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
from tests.test_megatron_import import CASES, TOKENS, _megalite_logits
from tools.convert_checkpoint import main as convert

pytest.importorskip("megatron.core")

NAMES = ("gpt2", "llama")
VOCAB = 95


def _megalite_checkpoint(folder: str, name: str, tp: int = 2, pp: int = 2) -> None:
    """A megalite checkpoint of the case's model, every tensor random (norms around 1), at TP2 x PP2."""
    config = config_from_args(CASES[name], VOCAB, name)
    g = torch.Generator().manual_seed(7)
    params = {k: 0.1 * torch.randn(shape, generator=g) + (1.0 if "norm.weight" in k else 0.0)
              for k, shape in full_shapes(config).items()}
    write_checkpoint(folder, config, params.__getitem__, tp=tp, pp=pp, iteration=5)


def _load_in_megatron(rank: int, world: int, root: str) -> dict:
    """Each export loaded by megatron-core at TP2 (model built from the saved args); logits from rank 0."""
    from tests.mcore_cpu import build_gpt, cpu_shim, logits

    cpu_shim()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    out = {}
    for name in NAMES:
        it_dir = os.path.join(root, name + "_mcore", "iter_0000005")
        args = load_torch_file(os.path.join(it_dir, "common.pt"))["args"]
        model = build_gpt(args, tp=2)
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, it_dir)  # as Megatron-LM loads
        assert state["iteration"] == 5 and state["args"].padded_vocab_size == 256
        model.load_state_dict(state["model"])
        got = logits(model, TOKENS, args.hidden_size)
        out[name] = got if rank == 0 else None
        # the legacy export, cut for TP2: this rank's file loaded strictly, as Megatron-LM's --load does
        legacy = os.path.join(root, name + "_legacy", "iter_0000005", f"mp_rank_{rank:02d}", "model_optim_rng.pt")
        saved = load_torch_file(legacy)
        assert saved["iteration"] == 5 and saved["args"].tensor_model_parallel_size == 2
        model = build_gpt(saved["args"], tp=2)
        model.load_state_dict(saved["model"], strict=True)
        got = logits(model, TOKENS, args.hidden_size)
        out[name + "_legacy"] = got if rank == 0 else None
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    for name in NAMES:  # at PP2: the torch_dist folder resharded by megatron-core, the legacy cut for TP1 x PP2
        it_dir = os.path.join(root, name + "_mcore", "iter_0000005")
        args = load_torch_file(os.path.join(it_dir, "common.pt"))["args"]
        model = build_gpt(args, tp=1, pp=2)
        model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, it_dir)["model"])
        out[name + "_pp2"] = logits(model, TOKENS, args.hidden_size)
        legacy = os.path.join(root, name + "_legacy_tp1pp2", "iter_0000005", f"mp_rank_00_{rank:03d}",
                              "model_optim_rng.pt")
        saved = load_torch_file(legacy)
        assert saved["args"].pipeline_model_parallel_size == 2
        model = build_gpt(saved["args"], tp=1, pp=2)
        model.load_state_dict(saved["model"], strict=True)
        out[name + "_legacy_tp1pp2"] = logits(model, TOKENS, args.hidden_size)
    ps.destroy_model_parallel()
    return {k: v for k, v in out.items() if v is not None}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("export"))
    for name in NAMES:
        _megalite_checkpoint(os.path.join(root, name), name)
        assert convert(["to-megatron", "--load", os.path.join(root, name), "--save",
                        os.path.join(root, name + "_mcore"), "--tensor-model-parallel-size", "2"]) == 0
        for suffix, tp, pp in (("_legacy", "2", "1"), ("_legacy_pp2", "2", "2"), ("_legacy_tp1pp2", "1", "2")):
            assert convert(["to-megatron", "--load", os.path.join(root, name), "--save",
                            os.path.join(root, name + suffix), "--format", "torch",
                            "--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp]) == 0
    ranks = run_ranks(_load_in_megatron, 2, root, timeout=120)
    return root, {**ranks[1], **ranks[0]}  # TP2 logits from rank 0, PP2 ones from the last stage (rank 1)


@pytest.mark.parametrize("fmt", ["", "_legacy", "_pp2", "_legacy_tp1pp2"])
@pytest.mark.parametrize("name", NAMES)
def test_megatron_core_loads_the_export_and_gives_megalite_logits(exported, name, fmt):
    """At TP2 (the torch_dist folder, the legacy cut for TP2) and at PP2 (the same torch_dist folder,
    resharded on load; the legacy cut for TP1 x PP2), from a megalite checkpoint saved at TP2 x PP2."""
    root, got = exported
    want = _megalite_logits(os.path.join(root, name), ProcessGroups.unconnected(RankLayout(1, 1, 1), 0))
    assert got[name + fmt].shape[-1] == (128 if fmt == "_legacy_tp1pp2" else 256)  # Megatron's padding of 95
    torch.testing.assert_close(got[name + fmt][..., :VOCAB], want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fmt", ["_mcore", "_legacy_pp2"])
@pytest.mark.parametrize("name", NAMES)
def test_the_export_imports_back_with_the_same_logits(exported, name, fmt, tmp_path):
    """from-megatron of the export (torch_dist; legacy cut for TP2 x PP2): the same model (the args saved
    with it describe it), the same logits."""
    root, _ = exported
    assert_imports_back(os.path.join(root, name + fmt), os.path.join(root, name), str(tmp_path / "back"))


def export_random(root: str, config: dict, tp: int, pp: int, formats: tuple[str, ...] = ("mcore", "legacy"),
                  check: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """A megalite checkpoint of ``config`` with random weights (norm weights near 1) written at tp x pp into
    root/megalite, and ``to-megatron`` of it at TP2 into root/<format> (torch_dist "mcore", "legacy"); the
    parameters it holds (each of ``check`` among them)."""
    g = torch.Generator().manual_seed(7)
    params = {k: 0.1 * torch.randn(shape, generator=g) + (1.0 if "norm.weight" in k else 0.0)
              for k, shape in full_shapes(config).items()}
    assert all(k in params for k in check), [k for k in check if k not in params]
    write_checkpoint(os.path.join(root, "megalite"), config, params.__getitem__, tp=tp, pp=pp, iteration=5)
    for out in formats:
        extra = ["--format", "torch"] if out == "legacy" else []
        assert convert(["to-megatron", "--load", os.path.join(root, "megalite"), "--save", os.path.join(root, out),
                        "--tensor-model-parallel-size", "2", *extra]) == 0
    return params


def assert_imports_back(megatron_dir: str, megalite_dir: str, back: str) -> None:
    """``from-megatron`` of an export gives the exported checkpoint's logits exactly (at TP1)."""
    assert convert(["from-megatron", "--load", megatron_dir, "--save", back]) == 0
    pg = ProcessGroups.unconnected(RankLayout(1, 1, 1), 0)
    torch.testing.assert_close(_megalite_logits(back, pg), _megalite_logits(megalite_dir, pg), rtol=0, atol=0)


def test_bad_layouts_are_refused_by_name(exported, tmp_path, capsys):
    root, _ = exported
    assert convert(["to-megatron", "--load", os.path.join(root, "gpt2"), "--save", str(tmp_path / "o"),
                    "--format", "torch", "--pipeline-model-parallel-size", "3"]) == 2
    assert "--pipeline-model-parallel-size (3) must divide --num-layers (2)" in capsys.readouterr().err
    # 2 KV groups at TP4: QKV's 64 rows divide by 4, but a cut there would split each group between two ranks
    assert convert(["to-megatron", "--load", os.path.join(root, "llama"), "--save", str(tmp_path / "o"),
                    "--format", "torch", "--tensor-model-parallel-size", "4"]) == 2
    assert "--tensor-model-parallel-size (4) must divide --num-query-groups (2)" in capsys.readouterr().err
    assert convert(["to-megatron", "--load", os.path.join(root, "gpt2"), "--save", str(tmp_path / "o"),
                    "--pipeline-model-parallel-size", "2"]) == 2
    assert "the flag is for --format torch" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o")
