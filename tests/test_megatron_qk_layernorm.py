"""Promise: --qk-layernorm (per head, Megatron-LM's semantics) crosses to and from megatron-core under its
names (``self_attention.q_layernorm`` / ``k_layernorm``). A megalite checkpoint (Llama-style, GQA, q/k norms,
random weights) saved at TP2 x PP2 is exported with ``to-megatron`` (torch_dist, and the legacy format cut for
TP2); megatron-core at TP2, built from the args the export saved, loads each and computes megalite's logits
(fp32, 1e-5); ``from-megatron`` of the export and of a checkpoint megatron-core saved itself gives back the
same logits. What megatron-core has no equivalent for (q/k norms over the projection, norms after the
sublayers) is refused by name."""

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
from tests.test_megatron_export import export_random
from tests.test_megatron_import import CASES, TOKENS, _megalite_logits, megatron_args
from tools.convert_checkpoint import main as convert

pytest.importorskip("megatron.core")

VOCAB = 95
ARGS = megatron_args(**{**vars(CASES["llama"]), "qk_layernorm": True})
PG = ProcessGroups.unconnected(RankLayout(1, 1, 1), 0)


def _in_megatron(rank: int, world: int, root: str) -> dict:
    """megatron-core at TP2 loads the torch_dist export and the legacy one (rank files strictly), and saves a
    model of its own with q/k norms; the logits from rank 0."""
    from tests.mcore_cpu import build_gpt, cpu_shim, logits, save_megatron

    cpu_shim()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    out = {}
    it_dir = os.path.join(root, "mcore", "iter_0000005")
    args = load_torch_file(os.path.join(it_dir, "common.pt"))["args"]
    assert args.qk_layernorm is True
    model = build_gpt(args, tp=2)
    assert model.decoder.layers[0].self_attention.q_layernorm is not None
    model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, it_dir)["model"])
    out["mcore"] = logits(model, TOKENS, args.hidden_size)
    legacy = os.path.join(root, "legacy", "iter_0000005", f"mp_rank_{rank:02d}", "model_optim_rng.pt")
    saved = load_torch_file(legacy)
    model = build_gpt(saved["args"], tp=2)
    model.load_state_dict(saved["model"], strict=True)
    out["legacy"] = logits(model, TOKENS, args.hidden_size)
    own = build_gpt(ARGS, tp=2, seed=3)  # megatron-core's own model, saved by it
    save_megatron(own, ARGS, os.path.join(root, "saved_by_mcore"), iteration=7)
    out["saved_by_mcore"] = logits(own, TOKENS, ARGS.hidden_size)
    ps.destroy_model_parallel()
    return out if rank == 0 else {}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("qk"))
    config = config_from_args(ARGS, VOCAB, "qk")
    assert config["qk_layernorm"] is True
    export_random(root, config, tp=2, pp=2, check=("layers.1.attention.q_norm.weight",
                                                   "layers.1.attention.k_norm.weight"))
    return root, run_ranks(_in_megatron, 2, root, timeout=120)[0]


@pytest.mark.parametrize("fmt", ["mcore", "legacy"])
def test_megatron_core_loads_the_export_with_qk_norms_and_gives_megalite_logits(exported, fmt):
    root, got = exported
    want = _megalite_logits(os.path.join(root, "megalite"), PG)
    torch.testing.assert_close(got[fmt][..., :VOCAB], want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("source", ["mcore", "saved_by_mcore"])
def test_from_megatron_reads_the_qk_norms(exported, source, tmp_path):
    root, got = exported
    back = str(tmp_path / "back")
    assert convert(["from-megatron", "--load", os.path.join(root, source), "--save", back]) == 0
    ours = _megalite_logits(back, PG)
    want = (_megalite_logits(os.path.join(root, "megalite"), PG) if source == "mcore"
            else got[source][..., :ours.shape[-1]])  # its args' padded vocabulary
    torch.testing.assert_close(ours, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("change, named", [
    ({"qk_layernorm_scope": "projection"}, "--qk-layernorm-scope projection is not exported"),
    ({"sublayer_norms": "post"}, "--sublayer-norms post is not exported")])
def test_what_megatron_core_lacks_is_refused_by_name(tmp_path, capsys, change, named):
    config = {**config_from_args(ARGS, VOCAB, "qk"), **change}
    params = {k: torch.ones(shape) for k, shape in full_shapes(config).items()}
    write_checkpoint(str(tmp_path / "m"), config, params.__getitem__, tp=1, pp=1, iteration=1)
    assert convert(["to-megatron", "--load", str(tmp_path / "m"), "--save", str(tmp_path / "o")]) == 2
    assert named in capsys.readouterr().err
