"""Promises of a checkpoint of a --grad-compression run (docs/checkpoints.md, "Gradient-compression state"):
- exact resume: 6 iterations straight and 3 + save + resume + 3 give the same loss curve (fp32, bitwise
  in practice; asserted at 1e-6) with PowerSGD and with int8, at DP 2: the error feedback, PowerSGD's Q
  and the warm-up count travel in the checkpoint;
- state that does not fit the resuming run (other gradient buckets, another DP size) starts afresh with a
  one-line notice, and the warm-up is not run again."""

from __future__ import annotations

import os
import types

import pytest

from megalite.checkpointing.compression_state import compression_filename, load_compression
from megalite.config import validate
from megalite.distributed.compression import GradCompressor
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.training.loop import pretrain
from tests.asserts import assert_rel_close
from tests.harness import run_ranks
from tests.tp_utils import LLAMA_GQA, layout_cfg, mock_data

VOCAB = 500
K = 3  # iterations before the save; as many after
MODEL = {**LLAMA_GQA, "num_layers": 2, "hidden_size": 32, "untie_embeddings_and_output_weights": False}
METHODS = {"powersgd": {"grad_compression": "powersgd", "powersgd_rank": 2},
           "int8": {"grad_compression": "int8"}}


def _train(rank: int, world: int, log=None, **extra):
    cfg = layout_cfg(MODEL, vocab=VOCAB, iters=2 * K, **{"grad_compression_warmup_steps": 1,
                                                         "ddp_bucket_size": 4000, **extra})
    validate(cfg, world)
    data = mock_data(VOCAB, MODEL["seq_length"], 1234, 2 * K * 8)
    return pretrain(cfg, ProcessGroups.build(RankLayout(world), rank), data=data, log=log or (lambda s: None))


def _runs(rank: int, world: int, root: str) -> dict:
    out: dict = {}
    for name, flags in METHODS.items():
        ck = os.path.join(root, name)
        straight = _train(rank, world, **flags).losses
        _train(rank, world, exit_interval=K, save=ck, **flags)
        resumed = _train(rank, world, load=ck, **flags).losses
        out[name] = {"straight": straight, "resumed": resumed}
    lines: list[str] = []  # other buckets: the state cannot be used
    _train(rank, world, log=lines.append, load=os.path.join(root, "powersgd"), **METHODS["powersgd"]
           | {"ddp_bucket_size": 2500})
    out["notice"] = [s for s in lines if "notice" in s]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("compressed"))
    return root, run_ranks(_runs, 2, root, timeout=400)


@pytest.mark.parametrize("method", list(METHODS))
def test_a_resumed_compressed_run_continues_the_uninterrupted_one(runs, method):
    for r in runs[1]:
        c = r[method]
        assert len(c["resumed"]) == K
        assert_rel_close(c["resumed"], c["straight"][K:], 1e-6, f"{method}: resumed vs straight loss")


def test_other_buckets_start_the_state_afresh_with_a_notice(runs):
    _, ranks = runs
    assert ranks[0]["notice"] == []  # the logging rank (the last) prints it
    (line,) = ranks[1]["notice"]
    assert "--grad-compression state" in line and "gradient buckets differ" in line and "\n" not in line


def test_another_dp_size_starts_the_state_afresh_with_a_notice(runs):
    """The DP 2 checkpoint's state, loaded by a one-rank compressor (DP 1): reset, named, warm-up kept done."""
    root, _ = runs
    ck = os.path.join(root, "powersgd")
    assert os.path.isfile(os.path.join(ck, f"iter_{K:07d}", compression_filename(1)))
    comp = GradCompressor("powersgd", ProcessGroups.single(), rank=2, warmup_steps=1)
    comp.errors, comp.qs = {0: object()}, {0: object()}  # whatever it held: reset
    buffers = [types.SimpleNamespace(compressor=comp, buckets=[types.SimpleNamespace(start=0, numel=10)])]
    lines: list[str] = []
    load_compression(ck, K, buffers, ProcessGroups.single(), lines.append)
    (line,) = lines
    assert "saved at DP 2, this run has DP 1" in line and "starts afresh" in line
    assert comp.errors == {} and comp.qs == {} and comp.calls_floor == K
