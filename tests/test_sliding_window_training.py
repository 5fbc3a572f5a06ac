"""Promise (attention/window.py): a model whose layers alternate sliding-window and full attention (Gemma 2's
pattern: --window-size 5 0 --window-attn-skip-freq 2, so layers 1 and 3 of 4 see 6 keys and layers 2 and 4
the whole past) trains 4 iterations with the serial loss curve and grad norms (fp32, relative 1e-5) at CP 2
(p2p, a2a, allgather), CP 4 (p2p, and a2a+p2p over 2 x 2), TP2 with SP and PP2, under NCCL's point-to-point
rules and (CP2 p2p, CP4 p2p) also on plain gloo; and the window changes the curve (it is not ignored)."""

from __future__ import annotations

import pytest

from tests.layouts import LayoutMatrix, serial_curve
from tests.tp_utils import LLAMA_GQA, layout_flat

VOCAB = 256
ITERS = 4
WINDOW = {"window_size": [5, 0], "window_attn_skip_freq": "2"}
MODELS = {"gemma2_pattern": {**LLAMA_GQA, "seq_length": 32, "num_layers": 4, **WINDOW}}
LAYOUTS = {
    "cp2_p2p": (1, 1, 2, {}),
    "cp2_a2a": (1, 1, 2, {"cp_comm_type": "a2a"}),
    "cp2_allgather": (1, 1, 2, {"cp_comm_type": "allgather"}),
    "cp4_p2p": (1, 1, 4, {}),
    "cp4_a2a_p2p": (1, 1, 4, {"cp_comm_type": "a2a+p2p", "hierarchical_context_parallel_sizes": [2, 2]}),
    "tp2_sp": (2, 1, 1, {"sequence_parallel": True}),
    "pp2": (1, 2, 1, {}),
}
CASES = [(m, n) for m in MODELS for n in LAYOUTS]
GLOO_CASES: list[tuple[str, str]] = []  # every case under NCCL's rules (gloo plus its checks) is enough


def flat(model: str, tp: int = 1, pp: int = 1, cp: int = 1, **extra) -> dict:
    return layout_flat(MODELS[model], vocab=VOCAB, iters=ITERS, tp=tp, pp=pp, context_parallel_size=cp, **extra)


MATRIX = LayoutMatrix(4, flat, LAYOUTS, CASES, GLOO_CASES)


@pytest.mark.parametrize("mode,model,layout", MATRIX.params())
def test_windowed_layers_give_the_serial_curve(mode, model, layout):
    MATRIX.check(mode, model, layout, ITERS)


def test_the_window_changes_the_curve():
    windowed = serial_curve(flat("gemma2_pattern"))
    full = serial_curve({k: v for k, v in flat("gemma2_pattern").items() if k not in WINDOW})
    assert windowed.losses != full.losses
