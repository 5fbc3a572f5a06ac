"""Promise: 10 training iterations at TP=2 (with DP=2) and TP=4 give the single-process loss curve and
grad norms (fp32, dropout 0, relative difference <= 1e-5 at every iteration)."""

from __future__ import annotations

import pytest

from megalite.config.arguments import MegaliteConfig
from megalite.training.loop import pretrain
from tests.asserts import assert_rel_close
from tests.harness import run_ranks
from tests.tp_utils import GPT2, LLAMA_GQA, groups_for, mock_data

VOCAB = 1000
ITERS = 10


def make_cfg(model_kw: dict, tp: int = 1, gbs: int = 8, **extra) -> MegaliteConfig:
    flat = dict(model_kw, tensor_model_parallel_size=tp, micro_batch_size=2, global_batch_size=gbs,
                train_iters=ITERS, lr=3e-3, lr_warmup_iters=2, min_lr=3e-4, log_interval=5, eval_iters=0,
                eval_interval=1000, mock_data=True, vocab_size=VOCAB, seed=1234, clip_grad=1.0, **extra)
    cfg = MegaliteConfig.from_flat(flat)
    from megalite.config import validate

    return cfg, validate


def _train(rank: int, world: int, layouts: list[tuple[str, int]]) -> dict:
    out = {}
    models = {"gpt2": GPT2, "llama": LLAMA_GQA}
    for name, tp in layouts:
        cfg, validate = make_cfg(models[name], tp)
        n_world = world if tp > 1 else 1
        validate(cfg, n_world)
        pg = groups_for(n_world, rank, tp=tp)
        data = mock_data(VOCAB, cfg.model.seq_length, cfg.training.seed, cfg.training.train_iters * 8)
        res = pretrain(cfg, pg, data=data, log=lambda s: None)
        out[(name, tp)] = (res.losses, res.grad_norms)
    return out


LAYOUTS = [(m, tp) for m in ("gpt2", "llama") for tp in (1, 2, 4)]


@pytest.fixture(scope="module")
def curves() -> list[dict]:
    return run_ranks(_train, 4, LAYOUTS)


@pytest.mark.parametrize("model", ["gpt2", "llama"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_loss_curve_matches_serial(curves, model, tp):
    ref_loss, ref_norm = curves[0][(model, 1)]
    assert all(n > 0 for n in ref_norm) and len(set(ref_loss)) == ITERS
    for rank, c in enumerate(curves):
        loss, norm = c[(model, tp)]
        assert len(loss) == ITERS
        assert_rel_close(loss, ref_loss, 1e-5, f"rank {rank}: loss vs serial")
        assert_rel_close(norm, ref_norm, 1e-5, f"rank {rank}: grad norm vs serial")


def test_single_process_training_reduces_loss():
    cfg, validate = make_cfg(GPT2, 1)
    cfg.training.train_iters, cfg.data.vocab_size = 40, 64
    validate(cfg, 1)
    res = pretrain(cfg, groups_for(1, 0), data=mock_data(64, 16, 1234, 40 * 8), log=lambda s: None)
    first, last = sum(res.losses[:5]) / 5, sum(res.losses[-5:]) / 5
    assert last < 0.7 * first, res.losses
