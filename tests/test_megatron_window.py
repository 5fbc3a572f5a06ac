"""Promise: --window-size / --window-attn-skip-freq cross to and from megatron-core under its names. A
megalite checkpoint (Llama-style, GQA, layers 1 and 3 windowed over 4 keys by --window-attn-skip-freq 2,
sequence 12 longer than the window, random weights) saved at TP2 x PP2 is exported with ``to-megatron``;
megatron-core at TP2 (local attention), built from the args the export saved, loads it and computes
megalite's logits (fp32, 1e-5); ``from-megatron`` of the export gives them back. megatron-core's local
attention builds its sliding-window mask on CUDA (``get_sliding_window_causal_mask``); on the CPU ranks here
the same function is computed on the CPU (the only change)."""

from __future__ import annotations

import os

import pytest
import torch

from megalite.checkpointing.megatron.args import config_from_args
from megalite.checkpointing.megatron.safe_pickle import load_torch_file
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout
from tests.harness import run_ranks
from tests.test_megatron_export import export_random
from tests.test_megatron_import import CASES, TOKENS, _megalite_logits, megatron_args
from tools.convert_checkpoint import main as convert

pytest.importorskip("megatron.core")

VOCAB = 95
ARGS = megatron_args(**{**vars(CASES["llama"]), "num_layers": 4, "window_size": (3, 0), "window_attn_skip_freq": 2})
PG = ProcessGroups.unconnected(RankLayout(1, 1, 1), 0)


def _cpu_window_mask(sq: int, skv: int, window_size) -> torch.Tensor:
    """megatron-core's get_sliding_window_causal_mask, on the CPU (True: masked)."""
    m = torch.ones(sq, skv, dtype=torch.bool)
    return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])


def _in_megatron(rank: int, world: int, root: str) -> dict:
    from tests.mcore_cpu import build_gpt, cpu_shim, logits

    cpu_shim()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.fusions import fused_softmax

    fused_softmax.get_sliding_window_causal_mask = _cpu_window_mask
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    it_dir = os.path.join(root, "mcore", "iter_0000005")
    args = load_torch_file(os.path.join(it_dir, "common.pt"))["args"]
    model = build_gpt(args, tp=2)
    windows = [layer.self_attention.core_attention.scale_mask_softmax.window_size for layer in model.decoder.layers]
    model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, it_dir)["model"])
    out = {"mcore": logits(model, TOKENS, args.hidden_size), "args": (args.window_size, args.window_attn_skip_freq),
           "windows": windows}
    ps.destroy_model_parallel()
    return out if rank == 0 else {}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("window"))
    config = config_from_args(ARGS, VOCAB, "window")
    assert config["window_size"] == [3, 0] and config["window_attn_skip_freq"] == "2"
    export_random(root, config, tp=2, pp=2, formats=("mcore",))
    return root, run_ranks(_in_megatron, 2, root, timeout=120)[0]


def test_megatron_core_runs_the_exported_window_with_megalites_logits(exported):
    root, got = exported
    assert got["args"] == ((3, 0), 2)
    assert got["windows"] == [(3, 0), None, (3, 0), None]  # megatron-core's own per-layer rule
    want = _megalite_logits(os.path.join(root, "megalite"), PG)
    torch.testing.assert_close(got["mcore"][..., :VOCAB], want, rtol=0, atol=1e-5)


def test_from_megatron_reads_the_window(exported, tmp_path):
    root, _ = exported
    back = str(tmp_path / "back")
    assert convert(["from-megatron", "--load", os.path.join(root, "mcore"), "--save", back]) == 0
    torch.testing.assert_close(_megalite_logits(back, PG), _megalite_logits(os.path.join(root, "megalite"), PG),
                               rtol=0, atol=1e-5)
