"""Promise (docs/parallelism.md, "Uneven pipeline stages"): a pipeline cut unevenly (Megatron-LM's
--decoder-first/last-pipeline-num-layers, the account-for flags, --num-virtual-stages-per-pipeline-rank, a
--pipeline-model-parallel-layout string; ZB-V's V) gives the single-process loss curve and grad norms (fp32,
relative 1e-5) under every schedule (1F1B, interleaved, GPipe, ZB-H1, ZB-V), with TP2 + SP, DP2 with the
distributed optimizer (ZB-V's also overlapping its grad reduce), full recomputation and MoE with EP2, under
NCCL's point-to-point rules (one also on plain gloo). Checkpoints are layout-free: one saved with an uneven
split continues at an even one on the uninterrupted curve and the other way round, a ZB-V checkpoint
continues under 1F1B and back; inference loads an uneven checkpoint at an uneven layout with the
single-process logits, and its Hugging Face export equals that of the same weights written evenly."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from megalite.checkpointing.reshard import reshard
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.placement import LayerSplit
from tests.cli_utils import load_tool
from tests.harness import run_ranks
from tests.layouts import assert_matches_serial, p2p_mode, serial_curve
from tests.tp_utils import LLAMA_GQA, layout_flat

VOCAB = 256
ITERS = 5
MODELS = {"l10": {**LLAMA_GQA, "num_layers": 10, "hidden_size": 32},
          "moe6": {**LLAMA_GQA, "num_layers": 6, "hidden_size": 32, "num_experts": 4, "moe_router_topk": 2,
                   "moe_ffn_hidden_size": 32}}
FIRST1_LAST3 = {"decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 3}
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
# name -> (tp, pp, cp, extra); all on 4 ranks, data parallelism fills the rest
LAYOUTS = {
    "pp2_tp2_sp_first3": (2, 2, 1, {"sequence_parallel": True, "decoder_first_pipeline_num_layers": 3}),
    "pp2_dp2_distopt_last4": (1, 2, 1, {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
                                        "decoder_last_pipeline_num_layers": 4}),
    "pp2_dp2_recompute_first4": (1, 2, 1, {**RECOMPUTE, "decoder_first_pipeline_num_layers": 4}),
    "pp2_ep2_first2": (1, 2, 1, {"expert_model_parallel_size": 2, "decoder_first_pipeline_num_layers": 2}),
    "pp2_interleaved_first2": (1, 2, 1, {"num_virtual_stages_per_pipeline_rank": 2,
                                         "decoder_first_pipeline_num_layers": 2}),
    "pp4_account_embedding_loss": (1, 4, 1, {"account_for_embedding_in_pipeline_split": True,
                                             "account_for_loss_in_pipeline_split": True}),
    "pp4_layout": (1, 4, 1, {"pipeline_model_parallel_layout": "E|t*4|ttt|t*3L"}),
    "zbv_pp2_first1_last3": (1, 2, 1, {"pipeline_schedule": "zbv", **FIRST1_LAST3}),
    "zbh1_pp4_first1_last3": (1, 4, 1, {"pipeline_schedule": "zb-h1", **FIRST1_LAST3}),
    "gpipe_pp4_first1_last3": (1, 4, 1, {"pipeline_schedule": "gpipe", **FIRST1_LAST3}),
    "zbv_pp2_tp2_sp_first1_last3": (2, 2, 1, {"pipeline_schedule": "zbv", "sequence_parallel": True,
                                              **FIRST1_LAST3}),
    "zbv_pp2_dp2_distopt_overlap_first1_last3": (1, 2, 1, {"pipeline_schedule": "zbv",
                                                           "use_distributed_optimizer": True,
                                                           "overlap_grad_reduce": True, **FIRST1_LAST3}),
}
CASES = [("l10", "pp2_tp2_sp_first3"), ("l10", "pp2_dp2_distopt_last4"),
         ("l10", "pp2_dp2_recompute_first4"), ("moe6", "pp2_ep2_first2"), ("l10", "pp2_interleaved_first2"),
         ("l10", "pp4_account_embedding_loss"), ("l10", "pp4_layout"), ("l10", "zbv_pp2_first1_last3"),
         ("l10", "zbh1_pp4_first1_last3"), ("l10", "gpipe_pp4_first1_last3"), ("l10", "zbv_pp2_tp2_sp_first1_last3"),
         ("l10", "zbv_pp2_dp2_distopt_overlap_first1_last3")]
# 1, 3, 3, 3 layers over 4 stages through pretrain_gpt.py, on plain gloo and under NCCL's rules: the
# pp4_uneven case of tests/test_cli_layouts.py


def flat(model: str, tp: int = 1, pp: int = 1, cp: int = 1, **extra) -> dict:
    return layout_flat(MODELS[model], vocab=VOCAB, iters=ITERS, tp=tp, pp=pp, context_parallel_size=cp, **extra)


@pytest.mark.parametrize("model,layout", CASES)
def test_uneven_curve_matches_serial(launch, model, layout):
    assert_matches_serial(launch["curves"], (model, layout), serial_curve(flat(model)), ITERS)


# ---- checkpoints across splits and placements -----------------------------------------------------------
CK_ITERS, SAVED_AT = 6, 3
EVEN_PP2 = (1, 2, {})
UNEVEN_PP4 = (1, 4, FIRST1_LAST3)
ZBV_UNEVEN = (1, 2, {"pipeline_schedule": "zbv", **FIRST1_LAST3})
# run name -> (layout, the checkpoint it saves at SAVED_AT or None, the checkpoint it resumes from or None)
CK_RUNS = {
    "uneven_saves": (UNEVEN_PP4, "uneven", None), "even_resumes_uneven": (EVEN_PP2, None, "uneven"),
    "even_saves": (EVEN_PP2, "even", None), "uneven_resumes_even": (UNEVEN_PP4, None, "even"),
    "zbv_saves": (ZBV_UNEVEN, "zbv", None), "1f1b_resumes_zbv": (EVEN_PP2, None, "zbv"),
    "zbv_resumes_1f1b": (ZBV_UNEVEN, None, "even"),
}
INFER = {"pipeline_model_parallel_size": 4, **FIRST1_LAST3, "tokenizer_type": "NullTokenizer",  # its EOD: + 1
         "vocab_size": VOCAB - 1}


def ck_flat(layout: tuple, root: str | None = None, save: str | None = None, load: str | None = None) -> dict:
    tp, pp, extra = layout
    paths = {"exit_interval": SAVED_AT, "save": os.path.join(root, save)} if save else {}
    if load:
        paths["load"] = os.path.join(root, load)
    return layout_flat(MODELS["l10"], vocab=VOCAB, iters=CK_ITERS, tp=tp, pp=pp, **extra, **paths)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, LLAMA_GQA["seq_length"]), generator=torch.Generator().manual_seed(3))


def _train_then_infer(rank: int, world: int, runs: dict, load: str) -> tuple[dict, torch.Tensor | None]:
    """The checkpoint runs one after another, then an inference forward of ``load`` at the uneven layout."""
    from megalite.inference.loading import load_model, plan
    from megalite.inference.pipeline import pipeline_forward
    from megalite.launch.run import build_groups
    from tests.layouts import _train_all

    curves = _train_all(rank, world, runs, {}, {}, None, None)
    p = plan({"load": load, **INFER}, world)
    pg = build_groups(p.cfg, world, rank)
    return curves, pipeline_forward(load_model(p, pg), pg, tokens())


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> dict:
    """One launch of 4 ranks for the module: the layout cases, then the checkpoint runs in order (each
    resume after its save), then the inference forward."""
    root = str(tmp_path_factory.mktemp("uneven_ck"))
    runs = {(m, n): flat(m, *LAYOUTS[n][:3], **LAYOUTS[n][3]) for m, n in CASES}
    runs.update({name: ck_flat(lay, root, save, load) for name, (lay, save, load) in CK_RUNS.items()})
    with p2p_mode("nccl_semantics"):
        per_rank = run_ranks(_train_then_infer, 4, runs, os.path.join(root, "uneven"), timeout=400)
    return {"root": root, "curves": [c for c, _ in per_rank], "logits": per_rank[-1][1]}


@pytest.mark.parametrize("name", [n for n, (_, save, load) in CK_RUNS.items() if load])
def test_resume_across_splits_continues_the_uninterrupted_curve(launch, name):
    ref = serial_curve(ck_flat((1, 1, {})))
    saved = [n for n, (_, s, _) in CK_RUNS.items() if s == CK_RUNS[name][2]][0]
    assert all(len(curves[saved].losses) == SAVED_AT for curves in launch["curves"])
    tail = type(ref)(ref.losses[SAVED_AT:], ref.grad_norms[SAVED_AT:], [])
    assert_matches_serial(launch["curves"], name, tail, CK_ITERS - SAVED_AT)


def test_metadata_records_each_ranks_layers(launch):
    def layout(name: str) -> dict:
        meta = os.path.join(launch["root"], name, f"iter_{SAVED_AT:07d}", "metadata.json")
        return json.load(open(meta))["layout"]

    assert layout("uneven")["chunk_layers"] == [[[0]], [[1, 2, 3]], [[4, 5, 6]], [[7, 8, 9]]]
    assert layout("zbv")["chunk_layers"] == [[[0], [7, 8, 9]], [[1, 2, 3], [4, 5, 6]]]
    assert layout("even")["chunk_layers"] == [[[0, 1, 2, 3, 4]], [[5, 6, 7, 8, 9]]]


def test_inference_at_an_uneven_layout_gives_the_single_process_logits(launch):
    from megalite.inference.loading import load_model, plan
    from megalite.inference.pipeline import pipeline_forward

    load = os.path.join(launch["root"], "uneven")
    chunks = load_model(plan({"load": load, **INFER, "pipeline_model_parallel_size": 1,
                              "decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None},
                             1), ProcessGroups.single())
    want = pipeline_forward(chunks, ProcessGroups.single(), tokens())
    assert launch["logits"] is not None
    torch.testing.assert_close(launch["logits"], want, rtol=1e-5, atol=1e-6)


def _hf_tensors(ckpt: str, out: str) -> dict[str, torch.Tensor]:
    assert load_tool("convert_checkpoint").main(["to-hf", "--load", ckpt, "--save", out,
                                                 "--tokenizer-type", "NullTokenizer"]) == 0
    return load_file(os.path.join(out, "model.safetensors"))


@pytest.mark.parametrize("saved", ["uneven", "zbv"])
def test_hf_export_of_an_uneven_checkpoint_equals_the_even_one(launch, tmp_path, saved):
    """The checkpoint as saved (uneven, or ZB-V's V), and the same weights written evenly over two stages
    (and, for the V, back to an uneven round-robin split): the same Hugging Face tensors, bit for bit."""
    src = os.path.join(launch["root"], saved)
    even = reshard(src, str(tmp_path / "even"), 1, 2)
    want = _hf_tensors(src, str(tmp_path / "hf_saved"))
    got = _hf_tensors(os.path.dirname(even), str(tmp_path / "hf_even"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    back = reshard(os.path.dirname(even), str(tmp_path / "back"), 1, 4, split=LayerSplit(10, 4, first=1, last=3))
    meta = json.load(open(os.path.join(back, "metadata.json")))["layout"]
    assert meta["chunk_layers"] == [[[0]], [[1, 2, 3]], [[4, 5, 6]], [[7, 8, 9]]]
    again = _hf_tensors(os.path.dirname(back), str(tmp_path / "hf_back"))
    assert all(torch.equal(want[k], again[k]) for k in want)
