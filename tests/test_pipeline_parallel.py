"""Promise: PP in {2, 4}, v in {1, 2}, alone and with TP=2, tied and untied embeddings, give the
single-process loss curve and grad norm (fp32, relative <= 1e-5 at every iteration over 5 iterations),
every layout under NCCL's point-to-point rules (MEGALITE_NCCL_SEMANTICS=1) and one also on plain gloo."""

from __future__ import annotations

import pytest

from tests.layouts import P2P_MODES, ModeCache, assert_matches_serial, layout_curves, p2p_mode, serial_curve
from tests.tp_utils import GPT2, LLAMA_GQA, layout_flat

VOCAB = 500
ITERS = 5
MODELS = {"gpt2_tied": {**GPT2, "num_layers": 8, "hidden_size": 32},
          "llama_untied": {**LLAMA_GQA, "num_layers": 8, "hidden_size": 32}}
# (tp, pp, layers per virtual stage or None)
LAYOUTS = [(1, 4, None), (1, 4, 1), (1, 2, None), (1, 2, 2), (2, 2, None), (2, 2, 2)]


# Plain gloo runs the layout that exercises the most (interleaved, with TP); NCCL semantics runs them all.
GLOO_LAYOUTS = [(2, 2, 2)]


def flat(model: str, tp: int, pp: int, vstage: int | None, schedule: str = "1f1b") -> dict:
    return layout_flat(MODELS[model], vocab=VOCAB, iters=ITERS, tp=tp, pp=pp,
                       num_layers_per_virtual_pipeline_stage=vstage, pipeline_schedule=schedule)


def _layouts(mode: str) -> list[dict]:
    layouts = LAYOUTS if mode == "nccl_semantics" else GLOO_LAYOUTS
    return layout_curves(4, {(m, layout): flat(m, *layout) for m in MODELS for layout in layouts})


CURVES = ModeCache(_layouts)
CASES = [(mode, m, layout) for mode in P2P_MODES for m in sorted(MODELS) for layout in LAYOUTS
         if mode == "nccl_semantics" or layout in GLOO_LAYOUTS]


@pytest.mark.parametrize("mode,model,layout", CASES, ids=lambda x: f"tp{x[0]}-pp{x[1]}-vstage{x[2]}"
                         if isinstance(x, tuple) else str(x))
def test_pipeline_loss_curve_matches_serial(mode, model, layout):
    assert_matches_serial(CURVES(mode), (model, layout), serial_curve(flat(model, 1, 1, None)), ITERS)


@pytest.mark.parametrize("mode", P2P_MODES)
def test_gpipe_matches_serial(mode):
    with p2p_mode(mode):
        curves = layout_curves(2, {m: flat(m, 1, 2, None, "gpipe") for m in MODELS})
    for m in MODELS:
        assert_matches_serial(curves, m, serial_curve(flat(m, 1, 1, None)), ITERS)
