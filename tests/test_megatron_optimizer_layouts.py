"""Promise (docs/checkpoints.md, "Optimizer state"): the Adam state of a megatron-core run with pipeline stages
(interleaved model chunks too) or with MoE experts imports with ``from-megatron``: the distributed optimizer's
default dp_reshardable buffers (one set per stage and chunk; an EP run's expert parameters in an optimizer of
their own) and, for MoE, the model-space states of its chained dense and expert optimizers (plain and
fully_reshardable). Every moment and main parameter equals what megatron-core's optimizer holds, joined over
TP, PP, EP and DP, exactly, and so does the step.

The reference is megatron-core on the CPU over gloo (tests/mcore_cpu.py, tests/mcore_train.py): two steps of
its own optimizer (``get_megatron_optimizer``) on 4 ranks, saved by ``dist_checkpointing.save`` as
Megatron-LM saves it; each rank lists its optimizer's own state per parameter (the distributed optimizer's:
this DP rank's slice of each parameter it owns), with global layer and expert numbers.
"""

from __future__ import annotations

import argparse
import os
import shutil

import pytest
import torch

from megalite.checkpointing.full_reader import FullCheckpoint
from megalite.checkpointing.megatron.names import to_megalite
from megalite.checkpointing.megatron.safe_pickle import load_torch_file
from tests.harness import run_ranks
from tests.test_megatron_import import CASES, TOKENS, megatron_args
from tools.convert_checkpoint import main as convert

pytest.importorskip("megatron.core")

STEPS = 2
DIST = ("dp_reshardable",)
ALL = ("plain", "fully_reshardable", "dp_reshardable")
# name -> (args, TP, PP, EP, model chunks per stage or None, the optimizer saves) on 4 ranks
PIPELINED = {"gpt2_tp2_pp2": (CASES["gpt2"], 2, 2, 1, None, DIST),
             "llama_tp2_pp2": (CASES["llama"], 2, 2, 1, None, DIST),
             "gpt2_tp1_pp2_vp2_dp2": (megatron_args(num_layers=4), 1, 2, 1, 2, DIST)}
MOE = {"mixtral_pp2_ep2": (CASES["mixtral"], 1, 2, 2, None, ALL),  # dense DP2; experts in their own optimizer
       "mixtral_pp2_ep1_dp2": (CASES["mixtral"], 1, 2, 1, None, DIST)}  # EP 1: the experts are dense parameters
# Saved in the legacy format too (distrib_optim.pt), with their DDP options: the interleaved run with overlapped
# gradient reduction in buckets of 150 (first-stage buckets closed off the 64-element grid: a rule that bucketed
# the second chunk, or missed the first one's, would give another layout).
LEGACY = {"gpt2_tp1_pp2_vp2_dp2": {"overlap_grad_reduce": True, "bucket_size": 150}, "mixtral_pp2_ep2": {},
          "mixtral_pp2_ep1_dp2": {}}


def _saved_args(args, tp: int, pp: int, ep: int, vp: int | None) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                 "expert_model_parallel_size": ep, "virtual_pipeline_model_parallel_size": vp})


def _save(chunks, opt, args, folder: str, sharding: str | None) -> None:
    """The run saved as Megatron-LM saves it (``sharding``: the distributed optimizer's; None: the plain
    optimizer, saved without metadata, so a chained optimizer prefixes its keys as older releases do)."""
    from tests.mcore_cpu import model_state, save_megatron
    from tests.mcore_train import MEGATRON_LM_METADATA

    metadata = None if sharding is None else {**MEGATRON_LM_METADATA, "distrib_optim_sharding_type": sharding}
    save_megatron(chunks, args, folder, STEPS, optimizer=opt.sharded_state_dict(model_state(chunks),
                                                                                 metadata=metadata))


def _save_legacy(chunks, opt, args, world: int, ddp: dict, folder: str) -> None:
    """The distributed run saved in the legacy format with distrib_optim.pt, its args as Megatron-LM saves them."""
    from tests.mcore_cpu import save_megatron_legacy

    flags = {"use_distributed_optimizer": True, "overlap_grad_reduce": ddp.get("overlap_grad_reduce", False),
             "ddp_bucket_size": ddp.get("bucket_size"),
             "data_parallel_size": world // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)}
    save_megatron_legacy(chunks, argparse.Namespace(**{**vars(args), **flags}), folder, STEPS, optimizer=opt,
                         distributed=True)


def _train_and_save(rank: int, world: int, root: str, layouts: dict) -> dict:
    """Each layout trained by megatron-core with the distributed optimizer (saved as dp_reshardable, and as
    fully_reshardable if asked, and in the legacy format if in LEGACY) and, if its plain save is asked, with
    the plain one; this rank's records of each."""
    from megatron.core import parallel_state as ps

    from tests.mcore_cpu import cpu_shim, optimizer_cpu_shim
    from tests.mcore_train import optimizer_records, train_gpt

    cpu_shim()
    optimizer_cpu_shim()
    out = {}
    for name, (args, tp, pp, ep, vp, saves) in layouts.items():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, virtual_pipeline_model_parallel_size=vp)
        args = _saved_args(args, tp, pp, ep, vp)
        chunks, opt = train_gpt(args, True, STEPS, TOKENS, tp, pp, ep, vp, **LEGACY.get(name, {}))
        out[name] = optimizer_records(chunks, opt, args)
        for sharding in [s for s in saves if s != "plain"]:  # every rank in the same order (collective saves)
            _save(chunks, opt, args, os.path.join(root, f"{name}_{sharding}"), sharding)
        if name in LEGACY:
            _save_legacy(chunks, opt, args, world, LEGACY[name], os.path.join(root, f"{name}_legacy"))
        if "plain" in saves:
            chunks, opt = train_gpt(args, False, STEPS, TOKENS, tp, pp, ep, vp)
            out[name + "_plain"] = optimizer_records(chunks, opt, args)
            _save(chunks, opt, args, os.path.join(root, f"{name}_plain"), None)
        ps.destroy_model_parallel()
    return out


def _merged(ranks: list[dict]) -> dict:
    return {name: [r for rank in ranks for r in rank[name]] for name in ranks[0]}


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("megatron_optim_pp"))
    return root, _merged(run_ranks(_train_and_save, 4, root, PIPELINED, timeout=300))


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("megatron_optim_moe"))
    return root, _merged(run_ranks(_train_and_save, 4, root, MOE, timeout=300))


def _check_import(load: str, records: list[tuple], args, out: str, capsys) -> None:
    """``from-megatron`` of ``load`` carries the reference state over exactly: every moment and main
    parameter under megalite's name, and the step."""
    from tests.mcore_train import reference_state

    assert convert(["from-megatron", "--load", load, "--save", out]) == 0
    said = capsys.readouterr().out
    assert f"Adam state of step {STEPS} imported" in said, said[-1500:]
    ckpt = FullCheckpoint(out)
    want, steps = reference_state(records, args.swiglu)
    assert steps == {float(STEPS)} and ckpt.optimizer_step() == STEPS
    for field, per in want.items():
        if not args.untie_embeddings_and_output_weights and "output_layer.weight" in per:  # the last stage's copy
            assert torch.equal(per.pop("output_layer.weight"), per["embedding.word_embeddings.weight"]), field
        full = to_megalite(list(per), per.__getitem__, "reference")
        assert sorted(full) == sorted(ckpt.keys())
        for key, t in full.items():
            assert field == "main" or torch.count_nonzero(t) > 0, (key, field)  # trained: something to compare
            torch.testing.assert_close(ckpt.optim(key, field), t, rtol=0, atol=0, msg=f"{key} {field}")


@pytest.mark.parametrize("name", list(PIPELINED))
def test_dp_reshardable_state_of_pipeline_stages_imports(pipelined, name, tmp_path, capsys):
    """TP2 x PP2 (GPT-2: tied embedding, its copy on the last stage in a bucket of its own; Llama: untied,
    SwiGLU, GQA) and TP1 x PP2 x DP2 with two interleaved model chunks per stage (a buffer per chunk)."""
    root, records = pipelined
    args = PIPELINED[name][0]
    _check_import(os.path.join(root, name + "_dp_reshardable"), records[name], args, str(tmp_path / "out"), capsys)


@pytest.mark.parametrize(("name", "fmt"), [(name, fmt) for name, layout in MOE.items() for fmt in layout[-1]])
def test_moe_optimizer_state_imports(moe, name, fmt, tmp_path, capsys):
    """A Mixtral-style run at PP2 x EP2 (dense DP2, expert DP1): the ChainedOptimizer's dense and expert
    optimizers, each saved with its own step, read as one state: the plain optimizer's model-space keys
    (``chained_<i>.`` prefixed), fully_reshardable's (unprefixed, as Megatron-LM saves them) and the
    dp_reshardable buffers (the expert optimizer's dp groups numbered over expert TP x EP x PP). At EP 1
    megatron-core keeps the experts in the dense buffer, after each layer's router: one optimizer."""
    root, records = moe
    ref = records[name + "_plain"] if fmt == "plain" else records[name]
    _check_import(os.path.join(root, f"{name}_{fmt}"), ref, MOE[name][0], str(tmp_path / "out"), capsys)


@pytest.mark.parametrize("name", list(LEGACY))
def test_legacy_distrib_optim_state_of_model_chunks_and_experts_imports(request, name, tmp_path, capsys):
    """The legacy format's distrib_optim.pt (megatron-core's own save_parameter_state) of the interleaved run
    (one buffer per model chunk, bucketed on the first stage's first chunk only) and of the MoE runs: at EP2 a
    ChainedOptimizer's list of the dense and the expert optimizer's states per mp_rank_TT_PPP_EEE folder (the
    dense one's only where its DP rank 0 saved it), at EP1 the experts in the dense buffer. Every moment and
    main parameter, joined over TP, PP and EP, exactly, and the step."""
    root, records = request.getfixturevalue("pipelined" if name in PIPELINED else "moe")
    args = {**PIPELINED, **MOE}[name][0]
    _check_import(os.path.join(root, name + "_legacy"), records[name], args, str(tmp_path / "out"), capsys)


def test_legacy_distrib_optim_state_without_the_dense_state_is_named_and_the_weights_import(moe, tmp_path, capsys):
    """The dense optimizer's state of an EP run is in its EP rank 0's files only (the other EP ranks' hold None
    for it): with it gone from them too, the weights import and the tool says which parameter lacks state."""
    folder = str(tmp_path / "no_dense")
    shutil.copytree(os.path.join(moe[0], "mixtral_pp2_ep2_legacy"), folder)
    path = os.path.join(folder, f"iter_{STEPS:07d}", "mp_rank_00_000_000", "distrib_optim.pt")
    states = load_torch_file(path)  # this test's own file: [dense, expert]
    torch.save([None, states[1]], path)
    assert convert(["from-megatron", "--load", folder, "--save", str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert "weights only;" in said and "no rank's file holds the optimizer state of embedding." in said, said[-1500:]


def test_chained_optimizers_with_different_steps_are_refused(moe, tmp_path):
    """megalite keeps one step: chained optimizers whose saved steps differ are refused in one line."""
    import contextlib
    import io

    folder = str(tmp_path / "steps")
    shutil.copytree(os.path.join(moe[0], "mixtral_pp2_ep2_plain"), folder)
    common = os.path.join(folder, f"iter_{STEPS:07d}", "common.pt")
    state = load_torch_file(common)  # this test's own file
    state["optimizer"][1]["state"]["common_step"] = torch.tensor(STEPS + 1.0)
    torch.save(state, common)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert convert(["from-megatron", "--load", folder, "--save", str(tmp_path / "out")]) == 2
    assert "chained optimizers hold different step counts [2.0, 3.0]" in err.getvalue()
    assert "Traceback" not in err.getvalue()


def test_stage_layers_are_found_by_fitting_each_virtual_stage_in_turn():
    """A stage's layer count is the one that fills its buffers (uneven stages and a chunk without layers
    included); none or several fitting is refused with the reason."""
    from megalite.checkpointing.megatron.torch_dist.dp_stages import stage_layers

    counts = {(0, 0): 1, (1, 0): 2, (0, 1): 0, (1, 1): 3}  # virtual stages 0, 1, 2, 3
    assert stage_layers(lambda p, c, r: len(r) == counts[p, c], 6, 2, 2) == {
        (0, 0): range(0, 1), (1, 0): range(1, 3), (0, 1): range(3, 3), (1, 1): range(3, 6)}
    assert "more than one count" in stage_layers(lambda p, c, r: True, 6, 2, 1)
    assert "no count" in stage_layers(lambda p, c, r: len(r) == 7, 6, 2, 1)


def _te_key(src, keys: list[str], grouped: bool):
    """Transformer Engine's registration order as a sort key: its dense order (``_ordered``'s ``LAYER_TE``),
    each layer's routed experts after its router, per expert fc1 and fc2 (SequentialMLP) or, ``grouped``,
    TEGroupedMLP's: its linear_fc1 GroupedLinear (weight0..weight{n-1}), then its linear_fc2."""
    import re

    from megalite.checkpointing.megatron.torch_dist.dp_optim import _ordered
    from megalite.checkpointing.megatron.torch_dist.dp_stages import split_expert_keys

    expert = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_(fc[12])\.weight$")
    rank = {p[0]: i for i, p in enumerate(_ordered(src, split_expert_keys(keys)[0], te=True))}

    def key(name: str) -> tuple:
        m = expert.match(name)
        if m is None:
            return rank.get(name, len(rank)), 0, "", 0  # the last stage's copy of a tied embedding: last
        router = max(i for n, i in rank.items() if n.startswith(f"decoder.layers.{m[1]}.mlp.router."))
        return (router, 1, m[3], int(m[2])) if grouped else (router, 1, int(m[2]), m[3])
    return key


def _spec_args(args, **spec) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **spec})


@pytest.mark.parametrize("name", [n for n, layout in MOE.items() if "dp_reshardable" in layout[-1]])
def test_dp_reshardable_state_of_grouped_experts_imports(moe, name):
    """Transformer Engine's grouped experts (TEGroupedMLP: ``moe_grouped_gemm``) lie in a layer's buffer as all
    its local experts' fc1 weights, then all their fc2 weights. megatron-core builds them only with Transformer
    Engine, so this run's real buckets (PP2 x EP2: the chained dense and expert optimizers, four expert dp
    groups; EP 1: the experts in the dense buffers) are moved into that order (tests/megatron_relaid.py): read
    with those args they give the SequentialMLP read's state exactly (every field); read as SequentialMLP's
    order (or the local spec's) they are refused by the fp32 parameters' check, not read wrong."""
    from megalite.checkpointing.megatron import read as mg
    from megalite.checkpointing.megatron.names import split_optimizer_keys
    from megalite.checkpointing.megatron.torch_dist.dp_optim import dp_reshardable_state
    from megalite.checkpointing.megatron.torch_dist.reader import DistCheckpoint
    from tests.megatron_relaid import RelaidBuffers

    folder = os.path.join(moe[0], f"{name}_dp_reshardable", f"iter_{STEPS:07d}")
    src = DistCheckpoint(folder)
    keys, _, other = split_optimizer_keys(src.keys())
    args = src.common["args"]
    grouped = RelaidBuffers(src, args, _te_key(src, keys, grouped=True))
    assert grouped.tensors and all(not torch.equal(t, src.tensor(k)) for k, t in grouped.tensors.items())
    te = _spec_args(args, transformer_impl="transformer_engine", moe_grouped_gemm=True)
    expected, step = dp_reshardable_state(src, keys, args)
    got = dp_reshardable_state(grouped, keys, te)
    assert not isinstance(got, str), got
    assert got[1] == step and sorted(got[0]) == sorted(expected)
    for field, per in expected.items():
        assert sorted(got[0][field]) == sorted(per), field
        assert all(torch.equal(got[0][field][n], t) for n, t in per.items()), field
    out = mg.read_megatron(os.path.dirname(folder))
    for spec, read in ((te, True), (_spec_args(te, moe_grouped_gemm=False), False), (args, False)):
        out.optimizer = None
        mg._dp_reshardable(out, grouped, keys, other, spec, folder)
        assert (out.optimizer is not None) == read, out.optimizer_note
    assert "is not the saved weight" in out.optimizer_note or "count of layers" in out.optimizer_note


def test_dp_reshardable_state_of_the_legacy_grouped_mlp_is_refused_with_the_reason(moe):
    """megatron-core's legacy GroupedMLP (the local spec's grouped GEMM, or Transformer Engine's with
    ``moe_use_legacy_grouped_gemm``) merges a layer's experts into weight1/weight2: its state is not read,
    the reason named, the weights imported."""
    from megalite.checkpointing.megatron import read as mg
    from megalite.checkpointing.megatron.names import split_optimizer_keys
    from megalite.checkpointing.megatron.torch_dist.reader import DistCheckpoint

    folder = os.path.join(moe[0], "mixtral_pp2_ep2_dp_reshardable", f"iter_{STEPS:07d}")
    src = DistCheckpoint(folder)
    keys, _, other = split_optimizer_keys(src.keys())
    out = mg.read_megatron(os.path.dirname(folder))
    args = src.common["args"]
    for spec in (_spec_args(args, moe_grouped_gemm=True),
                 _spec_args(args, transformer_impl="transformer_engine", moe_grouped_gemm=True,
                            moe_use_legacy_grouped_gemm=True)):
        out.optimizer = None
        mg._dp_reshardable(out, src, keys, other, spec, folder)
        assert out.optimizer is None and "legacy GroupedMLP" in out.optimizer_note, out.optimizer_note
        assert "weight1/weight2" in out.optimizer_note and "--dist-ckpt-optim-fully-reshardable" in out.optimizer_note
    assert out.params


@pytest.mark.parametrize("fmt", ["plain", "fully_reshardable"])
def test_model_space_state_of_grouped_experts_imports(moe, fmt, tmp_path, capsys):
    """TEGroupedMLP's sharded_state_dict saves its weight{i} under SequentialMLP's stacked expert keys (on the
    global expert's offset), so a grouped run's model-space optimizer state has this run's keys: saved with
    Transformer Engine's grouped args, it imports the same, exactly."""
    folder = str(tmp_path / "grouped")
    shutil.copytree(os.path.join(moe[0], f"mixtral_pp2_ep2_{fmt}"), folder)
    common = os.path.join(folder, f"iter_{STEPS:07d}", "common.pt")
    state = load_torch_file(common)  # this test's own file
    state["args"] = _spec_args(state["args"], transformer_impl="transformer_engine", moe_grouped_gemm=True)
    torch.save(state, common)
    ref = moe[1]["mixtral_pp2_ep2_plain" if fmt == "plain" else "mixtral_pp2_ep2"]
    _check_import(folder, ref, MOE["mixtral_pp2_ep2"][0], str(tmp_path / "out"), capsys)
