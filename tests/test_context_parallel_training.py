"""Promise (docs/parallelism.md, "Context parallelism"): 10 iterations with the sequence split over CP
ranks give the single-process loss curve and grad norms (fp32, relative 1e-5) for CP 4, CP2 x TP2 with
sequence parallelism, CP2 x PP2 interleaved, CP2 x DP2 with the distributed optimizer, each comm type,
GPT-2 and Llama GQA. (torchrun pretrain_gpt.py runs of the same layouts: tests/test_cli_layouts.py.)"""

from __future__ import annotations

import pytest

from megalite.config import validate
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.training.loop import pretrain
from tests.asserts import assert_rel_close
from tests.harness import run_ranks
from tests.tp_utils import GPT2, LLAMA_GQA, layout_cfg, mock_data

VOCAB = 256
ITERS = 10
MODELS = {"gpt2": {**GPT2, "seq_length": 32}, "llama": {**LLAMA_GQA, "seq_length": 32, "num_layers": 4}}
# name -> (tp, pp, cp, extra flags)
LAYOUTS = {
    "cp4": (1, 1, 4, {}),
    "cp4_a2a": (1, 1, 4, {"cp_comm_type": "a2a"}),  # GPT-2 only: Llama's 2 query groups do not split 4 ways
    "cp2_dp2_a2a": (1, 1, 2, {"cp_comm_type": "a2a"}),
    "cp2_tp2_sp": (2, 1, 2, {"sequence_parallel": True}),
    "cp2_pp2_interleaved": (1, 2, 2, {"num_layers_per_virtual_pipeline_stage": 1}),
    "cp2_dp2_distopt": (1, 1, 2, {"use_distributed_optimizer": True}),
    "cp2_dp2_allgather_recompute": (1, 1, 2, {"cp_comm_type": "allgather", "recompute_granularity": "full",
                                               "recompute_method": "uniform", "recompute_num_layers": 1}),
}
SKIP = {("gpt2", "cp2_pp2_interleaved"), ("llama", "cp4_a2a")}
CASES = [(m, n) for m in MODELS for n in LAYOUTS if (m, n) not in SKIP]


def _run(rank: int, world: int) -> dict:
    quiet = lambda s: None  # noqa: E731
    out = {}
    for model_name, model in MODELS.items():
        data = mock_data(VOCAB, model["seq_length"], 1234, ITERS * 8)
        cfg = layout_cfg(model, vocab=VOCAB, iters=ITERS)
        validate(cfg, 1)
        ref = pretrain(cfg, ProcessGroups.single(), data=data, log=quiet)
        out[(model_name, "serial")] = (ref.losses, ref.grad_norms)
        for name, (tp, pp, cp, extra) in LAYOUTS.items():
            if (model_name, name) not in CASES:
                continue
            cfg = layout_cfg(model, vocab=VOCAB, iters=ITERS, tp=tp, pp=pp, context_parallel_size=cp, **extra)
            validate(cfg, world)
            pg = ProcessGroups.build(RankLayout(world, tp, pp, cp), rank)
            res = pretrain(cfg, pg, data=data, log=quiet)
            out[(model_name, name)] = (res.losses, res.grad_norms)
    return out


@pytest.fixture(scope="module")
def curves(p2p_semantics) -> list[dict]:
    return run_ranks(_run, 4)


@pytest.mark.parametrize("model,layout", CASES)
def test_cp_loss_curve_matches_serial(curves, model, layout):
    ref_loss, ref_norm = curves[0][(model, "serial")]
    assert len(set(ref_loss)) == ITERS and all(n > 0 for n in ref_norm)
    for rank, c in enumerate(curves):
        loss, norm = c[(model, layout)]
        assert_rel_close(loss, ref_loss, 1e-5, f"{model} {layout} rank {rank}: loss vs serial")
        assert_rel_close(norm, ref_norm, 1e-5, f"{model} {layout} rank {rank}: grad norm vs serial")
