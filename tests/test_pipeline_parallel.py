"""Promise: PP in {2, 4}, v in {1, 2}, alone and with TP=2, tied and untied embeddings, give the
single-process loss curve and grad norm (fp32, relative <= 1e-5 at every iteration over 10 iterations)."""

from __future__ import annotations

import pytest

from megalite.config import validate
from megalite.config.arguments import MegaliteConfig
from megalite.training.loop import pretrain
from tests.asserts import assert_rel_close
from tests.harness import run_ranks
from tests.tp_utils import GPT2, LLAMA_GQA, groups_for, mock_data

VOCAB = 500
ITERS = 10
MODELS = {"gpt2_tied": {**GPT2, "num_layers": 8, "hidden_size": 32},
          "llama_untied": {**LLAMA_GQA, "num_layers": 8, "hidden_size": 32}}
# (tp, pp, layers per virtual stage or None)
LAYOUTS = [(1, 4, None), (1, 4, 1), (1, 2, None), (1, 2, 2), (2, 2, None), (2, 2, 2)]


def make_cfg(model_kw: dict, tp: int, pp: int, vstage: int | None, schedule: str = "1f1b") -> MegaliteConfig:
    return MegaliteConfig.from_flat(dict(
        model_kw, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        num_layers_per_virtual_pipeline_stage=vstage, pipeline_schedule=schedule, micro_batch_size=1,
        global_batch_size=8, train_iters=ITERS, lr=3e-3, lr_warmup_iters=2, log_interval=5, eval_iters=0,
        eval_interval=1000, mock_data=True, vocab_size=VOCAB, seed=1234))


def _run(rank: int, world: int, layouts, schedule: str) -> dict:
    out = {}
    for model, kw in MODELS.items():
        cfg = make_cfg(kw, 1, 1, None)
        validate(cfg, 1)
        data = mock_data(VOCAB, cfg.model.seq_length, 1234, ITERS * 8)
        ref = pretrain(cfg, groups_for(1, 0), data=data, log=lambda s: None)
        out[(model, "serial")] = (ref.losses, ref.grad_norms)
        for tp, pp, vs in layouts:
            cfg = make_cfg(kw, tp, pp, vs, schedule)
            validate(cfg, world)
            res = pretrain(cfg, groups_for(world, rank, tp=tp, pp=pp), data=data, log=lambda s: None)
            out[(model, (tp, pp, vs))] = (res.losses, res.grad_norms)
    return out


@pytest.fixture(scope="module")
def curves(p2p_semantics) -> list[dict]:
    return run_ranks(_run, 4, LAYOUTS, "1f1b", timeout=400)


def _assert_same(curve, ref, what):
    for name, got, want in (("loss", curve[0], ref[0]), ("grad norm", curve[1], ref[1])):
        assert len(got) == ITERS
        assert_rel_close(got, want, 1e-5, f"{what} {name} vs serial")


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"tp{x[0]}-pp{x[1]}-vstage{x[2]}")
def test_pipeline_loss_curve_matches_serial(curves, model, layout):
    for rank, c in enumerate(curves):
        _assert_same(c[(model, layout)], c[(model, "serial")], f"rank {rank} {layout}")


def test_gpipe_matches_serial(p2p_semantics):
    curves = run_ranks(_run, 2, [(1, 2, None)], "gpipe")
    for model in MODELS:
        _assert_same(curves[1][(model, (1, 2, None))], curves[1][(model, "serial")], "gpipe")
