"""Promise: 5 training iterations at TP=2 (with DP=2) and TP=4 give the single-process loss curve and
grad norms (fp32, dropout 0, relative difference <= 1e-5 at every iteration)."""

from __future__ import annotations

import pytest

from tests.layouts import assert_matches_serial, layout_curves, serial_curve
from tests.tp_utils import GPT2, LLAMA_GQA, layout_flat

VOCAB = 1000
ITERS = 5


MODELS = {"gpt2": GPT2, "llama": LLAMA_GQA}


def flat(model: str, tp: int = 1) -> dict:
    return layout_flat(MODELS[model], vocab=VOCAB, iters=ITERS, tp=tp, micro_batch_size=2, min_lr=3e-4,
                       clip_grad=1.0)


@pytest.fixture(scope="module")
def curves() -> list[dict]:
    return layout_curves(4, {(m, tp): flat(m, tp) for m in MODELS for tp in (2, 4)})


@pytest.mark.parametrize("model", ["gpt2", "llama"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_loss_curve_matches_serial(curves, model, tp):
    assert_matches_serial(curves, (model, tp), serial_curve(flat(model)), ITERS)
