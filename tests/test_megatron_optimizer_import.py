"""Promise (docs/checkpoints.md, "Megatron-LM checkpoints"): a torch_dist checkpoint Megatron-LM saved with
its optimizer (its default) imports, and ``from-megatron`` carries its Adam state over: every parameter's
moments under megalite's name, full, and the step count.

The reference is megatron-core on the CPU over gloo (tests/mcore_cpu.py): its GPTModel at TP2 wrapped in
its DistributedDataParallel, its optimizer from ``get_megatron_optimizer`` (torch's AdamW when neither
apex nor Transformer Engine is installed), two steps, then ``dist_checkpointing.save`` of the model's and
the optimizer's sharded state as Megatron-LM's training loop saves them. Each rank also keeps its own
moments per parameter name, joined here over TP by the parameter's own ``partition_dim``. The legacy
format's ``distrib_optim.pt`` (the distributed optimizer's own ``save_parameter_state``) is checked against
that optimizer's own state (each DP rank's slices, its fp32 main parameters included), at TP2, TP2 x DP2
and TP2 x PP2 (there on gradients set by hand, no pipeline schedule needed).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from megalite.checkpointing.full_reader import FullCheckpoint
from megalite.checkpointing.megatron.names import to_megalite
from megalite.checkpointing.megatron.safe_pickle import load_torch_file
from tests.harness import run_ranks
from tests.test_megatron_import import CASES, TOKENS, megatron_args
from tools.convert_checkpoint import main as convert

pytest.importorskip("megatron.core")

NAMES = ("gpt2", "llama")
STEPS = 2


def _wrapped(model, distributed: bool, **ddp_options):
    """megatron-core's DistributedDataParallel around ``model`` and its optimizer (Adam, lr 1e-3, weight decay
    0.1, no clipping; the distributed one with ``distributed``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed, **ddp_options)
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, clip_grad=0.0,
                                                 bf16=False, fp16=False, use_distributed_optimizer=distributed), [ddp])
    return ddp, opt


def _train(args, distributed: bool, **ddp_options):
    """megatron-core's model at TP2 with its optimizer (the distributed one with ``distributed``) after
    STEPS steps of the same loss on the same tokens (``ddp_options``: more of its DistributedDataParallelConfig)."""
    from tests.mcore_cpu import build_gpt

    model = build_gpt(args, tp=2).train()
    ddp, opt = _wrapped(model, distributed, **ddp_options)
    b, s = TOKENS.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    for _ in range(STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(TOKENS, torch.arange(s).expand(b, s), mask).square().mean().backward()
        ddp.finish_grad_sync()
        assert opt.step()[0]
    return model, opt


def _megatron_at_tp2():
    """megatron-core's model and optimizers on the CPU (the shims), its parallel state at TP2."""
    from tests.mcore_cpu import cpu_shim, optimizer_cpu_shim

    cpu_shim()
    optimizer_cpu_shim()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    return ps


def _moments(model, opt) -> dict:
    """This rank's Adam state per megatron-core parameter name, with the dim the parameter is cut on (-1:
    replicated), from the plain optimizer."""
    inner = opt.chained_optimizers[0].optimizer if hasattr(opt, "chained_optimizers") else opt.optimizer
    return {n: ({k: v.clone() for k, v in inner.state[p].items()},
                getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1)
            for n, p in model.named_parameters()}


def _own_state(model, opt, layer_offset: int = 0) -> dict:
    """This rank's slice of each parameter's state in megatron-core's distributed optimizer itself (its fp32
    main parameter as ``main``): name (layers numbered from ``layer_offset``) -> (the slice's start in the
    flattened parameter, the parameter's shape, {field: flat slice}, the dim it is cut on)."""
    import re

    inner = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    out = {}
    for n, p in model.named_parameters():
        if p not in inner.model_param_group_index_map:
            continue  # none of it on this DP rank
        start = inner._get_model_param_range_map(p)["param"].start
        state = inner._get_main_param_and_optimizer_states(p)
        name = re.sub(r"decoder\.layers\.(\d+)", lambda m: f"decoder.layers.{int(m[1]) + layer_offset}", n)
        out[name] = (start, p.shape, {f: state[k].detach().clone() for f, k in
                                      (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("main", "param"))},
                     getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1)
    return out


def _assembled(slices: list[dict]) -> dict:
    """One TP rank's full state per parameter from its DP ranks' slices (``_own_state``), which must cover
    each parameter exactly once: name -> ({field: tensor}, cut dim), as ``_moments`` gives it."""
    out = {}
    for name in dict.fromkeys(n for s in slices for n in s):
        parts = sorted((s[name] for s in slices if name in s), key=lambda part: part[0])
        shape, dim = parts[0][1], parts[0][3]
        assert [part[0] for part in parts] == [sum(q[2]["main"].numel() for q in parts[:i]) for i in range(len(parts))]
        out[name] = ({f: torch.cat([part[2][f] for part in parts]).view(shape) for f in parts[0][2]}, dim)
    return out


def _distributed_args(args, **ddp):
    """The args Megatron-LM saves for a distributed-optimizer run of ``args`` with these DDP flags."""
    import argparse

    return argparse.Namespace(**{**vars(args), "use_distributed_optimizer": True, **ddp})


def _train_and_save(rank: int, world: int, root: str) -> dict:
    """Each case trained by megatron-core at TP2 and saved with its optimizer: the plain optimizer in
    torch_dist and in the legacy format, the distributed one in torch_dist as ``fully_reshardable`` and as
    ``dp_reshardable`` (Megatron-LM's default) and in the legacy format (``distrib_optim.pt``); this rank's
    moments of the plain optimizer per parameter name, with how the parameter is cut, and the distributed
    optimizer's own state (``<name>_distrib``). The plain saves hold this rank's RNG states as Megatron-LM
    writes them (``<name>_rng``: the dict saved), torch_dist's as its ``rng_state`` ShardedObject."""
    from tests.mcore_cpu import megatron_rng_state, rng_sharded_object, save_megatron, save_megatron_legacy

    ps = _megatron_at_tp2()
    out = {}
    for name in NAMES:
        args = CASES[name]
        model, opt = _train(args, distributed=False)
        out[name + "_rng"] = rng = megatron_rng_state()
        save_megatron(model, args, os.path.join(root, name), STEPS,
                      optimizer=opt.sharded_state_dict(model.sharded_state_dict()), rng=rng_sharded_object([rng]))
        save_megatron_legacy(model, args, os.path.join(root, name + "_legacy"), STEPS, optimizer=opt.state_dict(),
                             rng=[rng])
        out[name] = _moments(model, opt)
        model, opt = _train(args, distributed=True)
        for sharding in ("fully_reshardable", "dp_reshardable"):
            state = opt.sharded_state_dict(model.sharded_state_dict(),
                                           metadata={"distrib_optim_sharding_type": sharding})
            save_megatron(model, args, os.path.join(root, f"{name}_{sharding}"), STEPS, optimizer=state)
        save_megatron_legacy(model, _distributed_args(args), os.path.join(root, f"{name}_distrib"), STEPS,
                             optimizer=opt, distributed=True)
        out[name + "_distrib"] = _own_state(model, opt)
    ps.destroy_model_parallel()
    return out


def _train_and_save_dp2(rank: int, world: int, root: str) -> dict:
    """At TP2 x DP2 (the same tokens on both DP ranks): the plain optimizer's moments, and the distributed
    optimizer saved as ``dp_reshardable``, each bucket split over the two DP ranks; GPT-2's buffer cut into
    several buckets (overlapped gradient reduction with a small bucket size), Llama's in one; and the same
    state in the legacy format (``distrib_optim.pt``, gathered on DP rank 0) with each rank's own slices.
    The RNG states differ per DP rank (seeded apart, as --data-parallel-random-init does) and are saved as
    Megatron-LM 0.16 writes them: GPT-2's per DP rank (its layout with expert parallelism, shape (PP, TP,
    DP)), Llama's as DP rank 0's list of every DP rank's state (shape (PP, TP))."""
    import torch.distributed as dist

    from tests.mcore_cpu import megatron_rng_state, rng_sharded_object, save_megatron, save_megatron_legacy

    ps = _megatron_at_tp2()
    out = {}
    for name in NAMES:
        args = CASES[name]
        model, opt = _train(args, distributed=False)
        out[name] = _moments(model, opt)
        options = {"overlap_grad_reduce": True, "bucket_size": 3000} if name == "gpt2" else {}
        model, opt = _train(args, distributed=True, **options)
        state = opt.sharded_state_dict(model.sharded_state_dict(), metadata={"distrib_optim_sharding_type":
                                                                              "dp_reshardable"})
        torch.manual_seed(100 + ps.get_data_parallel_rank())
        out[name + "_rng"] = rng = megatron_rng_state()
        gathered = [None] * ps.get_data_parallel_world_size()
        dist.all_gather_object(gathered, rng, group=ps.get_data_parallel_group())
        rng_state = rng_sharded_object([rng], per_dp=True) if name == "gpt2" else rng_sharded_object(gathered)
        save_megatron(model, args, os.path.join(root, f"{name}_dp2"), STEPS, optimizer=state, rng=rng_state)
        flags = {"overlap_grad_reduce": True, "ddp_bucket_size": 3000} if name == "gpt2" else {}
        save_megatron_legacy(model, _distributed_args(args, data_parallel_size=2, **flags),
                             os.path.join(root, f"{name}_distrib_dp2"), STEPS, optimizer=opt, distributed=True)
        out[name + "_distrib"] = _own_state(model, opt)
    ps.destroy_model_parallel()
    out["pp2"] = _train_and_save_pp2(root)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("megatron_optim"))
    return root, run_ranks(_train_and_save, 2, root, timeout=180)


@pytest.fixture(scope="module")
def saved_dp2(tmp_path_factory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("megatron_optim_dp2"))
    return root, run_ranks(_train_and_save_dp2, 4, root, timeout=300)  # TP rank = rank % 2, DP rank = rank // 2


# The TP2 x PP2 saves, folder: bucket size. Each is sized so that a rule of megatron-core's bucketing moves
# the state (a bucket ending off the 64-element grid shifts what follows): with 3000 the first stage's bucket
# before its embedding's own ends at the next aligned start, past the 17-position embedding (544 elements);
# with 150 the size closes first-stage buckets off the grid (after the 48-element QKV bias) and would close
# the second stage's, which are not bucketed; in both the second stage's tied output layer (47 rows of 32 at
# TP2, off the grid) is alone in its bucket.
PP2_SAVES = {"gpt2_distrib_pp2": 3000, "gpt2_distrib_pp2_b150": 150}


def _train_and_save_pp2(root: str) -> dict:
    """GPT-2 (tied) at TP2 x PP2 with megatron-core's distributed optimizer (overlapped gradient reduction, each
    bucket size of PP2_SAVES), STEPS steps on gradients set by hand (the same on both copies of the embedding;
    no pipeline schedule needed), saved in the legacy format with distrib_optim.pt; per folder, this rank's
    TP rank and own state, layers numbered over the whole model. (On the TP2 x DP2 fixture's ranks.)"""
    from megatron.core import parallel_state as ps

    from tests.mcore_cpu import _global_seed, build_gpt, save_megatron_legacy

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    args = megatron_args(max_position_embeddings=17, padded_vocab_size=94)  # GPT-2's case, off the grid
    tp_rank, offset = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank() * args.num_layers // 2
    out = {}
    for folder, bucket in PP2_SAVES.items():
        model = build_gpt(args, tp=2, pp=2).train()
        ddp, opt = _wrapped(model, True, overlap_grad_reduce=True, bucket_size=bucket)
        for step in range(STEPS):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            for n, p in model.named_parameters():
                sharded = getattr(p, "tensor_model_parallel", False)
                seed = _global_seed(n, offset, True) + 7 * step + (tp_rank + 1 if sharded else 0)
                p.main_grad.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
            assert opt.step()[0]
        save_megatron_legacy(model, _distributed_args(args, overlap_grad_reduce=True, ddp_bucket_size=bucket),
                             os.path.join(root, folder), STEPS, optimizer=opt, distributed=True)
        out[folder] = {"tp": tp_rank, "state": _own_state(model, opt, offset)}
    ps.destroy_model_parallel()
    return out


def _joined(per_rank: list[dict], name: str, field: str, swiglu: bool) -> torch.Tensor:
    """The full moment of one megatron-core parameter from its TP shards (SwiGLU's fc1 as [gate; up])."""
    shards = [r[name][0][field] for r in per_rank]
    dim = per_rank[0][name][1]
    if dim < 0:
        assert all(torch.equal(t, shards[0]) for t in shards)
        return shards[0]
    if swiglu and "linear_fc1" in name:
        halves = [t.chunk(2) for t in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(shards, dim=dim)


def _check_import(load: str, per_rank: list[dict], name: str, out: str, capsys) -> None:
    """``from-megatron`` of ``load`` carries the reference moments (and fp32 main parameters, where the reference
    has them) over exactly, and the step count."""
    assert convert(["from-megatron", "--load", load, "--save", out, "--tensor-model-parallel-size", "2"]) == 0
    assert f"Adam state of step {STEPS} imported" in capsys.readouterr().out
    ckpt = FullCheckpoint(out)
    assert ckpt.has_optimizer() and ckpt.optimizer_step() == STEPS
    names = list(per_rank[0])
    for field in [f for f in ("exp_avg", "exp_avg_sq", "main") if f in per_rank[0][names[0]][0]]:
        want = to_megalite(names, lambda n, f=field: _joined(per_rank, n, f, CASES[name].swiglu), "reference")
        assert sorted(want) == sorted(ckpt.keys())
        for key, t in want.items():
            assert torch.count_nonzero(t) > 0, key  # two steps of a real gradient: the test compares something
            torch.testing.assert_close(ckpt.optim(key, field), t, rtol=0, atol=0, msg=f"{key} {field}")
    for key in ckpt.keys():  # an fp32 run's main parameters are its weights
        torch.testing.assert_close(ckpt.optim(key, "main"), ckpt.param(key).float(), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["", "_legacy", "_fully_reshardable", "_dp_reshardable"])
@pytest.mark.parametrize("name", NAMES)
def test_from_megatron_carries_the_adam_state_over(saved, name, fmt, tmp_path, capsys):
    """torch_dist (model-space keys), the legacy format (torch's numbering, rebuilt from megatron-core's
    default parameter groups, each TP rank's file joined as its weights are), and the distributed
    optimizer's fully_reshardable and dp_reshardable torch_dist states (the same run's moments as the
    plain optimizer's)."""
    root, ranks = saved
    _check_import(os.path.join(root, name + fmt), [r[name] for r in ranks], name, str(tmp_path / "imported"), capsys)


@pytest.mark.parametrize("name", NAMES)
def test_dp_reshardable_state_split_over_dp_ranks_imports(saved_dp2, name, tmp_path, capsys):
    """The dp_reshardable state of a TP2 x DP2 run (each bucket's flat range cut between the DP ranks;
    GPT-2's in four buckets) is the plain optimizer's moments of the same run."""
    root, ranks = saved_dp2
    _check_import(os.path.join(root, name + "_dp2"), [r[name] for r in ranks[:2]], name, str(tmp_path / "out"),
                  capsys)  # DP rank 0's TP ranks


@pytest.mark.parametrize("name", NAMES)
def test_legacy_distrib_optim_state_imports(saved, saved_dp2, name, tmp_path, capsys):
    """The legacy format's distrib_optim.pt (megatron-core's save_parameter_state) of a TP2 run and of a TP2 x
    DP2 run (gathered from both DP ranks; GPT-2's buffer in four buckets) is the distributed optimizer's own
    state: every moment and fp32 main parameter, joined over TP, exactly, and the step."""
    root, ranks = saved
    own = [_assembled([r[name + "_distrib"]]) for r in ranks]
    _check_import(os.path.join(root, name + "_distrib"), own, name, str(tmp_path / "tp2"), capsys)
    root, ranks = saved_dp2
    own = [_assembled([r[name + "_distrib"] for r in ranks[t::2]]) for t in range(2)]
    assert all(len(r[name + "_distrib"]) < len(own[0]) for r in ranks)  # each DP rank holds only part of it
    _check_import(os.path.join(root, name + "_distrib_dp2"), own, name, str(tmp_path / "dp2"), capsys)


@pytest.mark.parametrize("folder", PP2_SAVES)
def test_legacy_distrib_optim_state_of_pipeline_stages_imports(saved_dp2, folder, tmp_path, capsys):
    """At TP2 x PP2 each stage's file holds its own buffer (the tied embedding's copies alone in their buckets;
    the bucket size applied to the first stage only): joined over TP and PP, the optimizer's own state."""
    root, ranks = saved_dp2
    own = []
    for t in range(2):
        state = {k: v for r in ranks if r["pp2"][folder]["tp"] == t for k, v in r["pp2"][folder]["state"].items()}
        state.pop("output_layer.weight")  # the last stage's copy of the tied embedding: not imported
        own.append(_assembled([state]))
    _check_import(os.path.join(root, folder), own, "gpt2", str(tmp_path / "out"), capsys)


def test_legacy_distrib_optim_state_that_does_not_fit_is_named_and_the_weights_import(saved, tmp_path, capsys):
    """A legacy distributed-optimizer folder whose state is not read imports the weights only, saying why: one
    rank's distrib_optim.pt missing, or args whose bucket size gives another buffer layout."""
    import shutil

    source = os.path.join(saved[0], "gpt2_distrib")
    missing, buckets = str(tmp_path / "missing"), str(tmp_path / "buckets")
    shutil.copytree(source, missing)
    os.remove(os.path.join(missing, f"iter_{STEPS:07d}", "mp_rank_01", "distrib_optim.pt"))
    shutil.copytree(source, buckets)
    for rank in ("mp_rank_00", "mp_rank_01"):
        path = os.path.join(buckets, f"iter_{STEPS:07d}", rank, "model_optim_rng.pt")
        state = load_torch_file(path)  # this test's own file
        state["args"].overlap_grad_reduce, state["args"].ddp_bucket_size = True, 1  # a bucket per parameter
        torch.save(state, path)
    for folder, reason in ((missing, os.path.join("mp_rank_01", "distrib_optim.pt is missing")),
                           (buckets, "layout not matched")):
        out = str(tmp_path / (os.path.basename(folder) + "_weights"))
        assert convert(["from-megatron", "--load", folder, "--save", out]) == 0
        said = capsys.readouterr().out
        assert "weights only; " in said and reason in said, said
        assert not FullCheckpoint(out).has_optimizer()


def test_dp_reshardable_state_of_an_unread_layout_is_named_and_the_weights_import(saved, tmp_path, capsys):
    """A dp_reshardable state whose buffers do not follow the order its args name (the local spec's buckets,
    the args saying Transformer Engine's spec) imports the weights only, saying why."""
    import shutil

    folder = str(tmp_path / "te")
    shutil.copytree(os.path.join(saved[0], "gpt2_dp_reshardable"), folder)
    common = os.path.join(folder, f"iter_{STEPS:07d}", "common.pt")
    state = load_torch_file(common)  # this test's own file
    state["args"].transformer_impl = "transformer_engine"
    torch.save(state, common)
    out = str(tmp_path / "weights")
    assert convert(["from-megatron", "--load", folder, "--save", out]) == 0
    said = capsys.readouterr().out
    assert "weights only; its optimizer state is the distributed optimizer's dp_reshardable" in said
    assert "which is not read (optimizer main: " in said and "TP rank 1 holds other values" in said
    assert "--dist-ckpt-optim-fully-reshardable" in said and "--no-load-optim" in said
    assert not FullCheckpoint(out).has_optimizer()


def test_dp_reshardable_layout_must_fill_every_bucket_exactly():
    """The rebuilt layout (reverse order, starts rounded up to 64 elements, the TP cut) is checked against the
    saved bucket sizes: one element more or less, or a bucket too many, is refused with the reason; a bucket
    may end at the next aligned start after its last parameter."""
    from megalite.checkpointing.megatron.torch_dist.dp_optim import _place

    params = [("a", (4, 3), 0), ("b", (4,), -1), ("c", (100,), -1)]
    assert _place(params, 2, [198]) == {"c": (0, 0, (100,)), "b": (0, 128, (4,)), "a": (0, 192, (2, 3))}
    assert _place(params, 2, [100, 4, 6]) == {"c": (0, 0, (100,)), "b": (1, 0, (4,)), "a": (2, 0, (2, 3))}
    # a bucket closed at the next aligned start (megatron-core's, before a stage's shared embedding)
    assert _place(params, 2, [128, 4, 6]) == {"c": (0, 0, (100,)), "b": (1, 0, (4,)), "a": (2, 0, (2, 3))}
    for sizes in ([197], [199], [100, 98], [198, 10], [127, 4, 6], [129, 4, 6]):
        assert isinstance(_place(params, 2, sizes), str), sizes
    assert isinstance(_place([("d", (3, 4), 0)], 2, [6]), str)  # 3 rows do not split over TP 2


def test_no_load_optim_imports_the_weights_only(saved, tmp_path, capsys):
    root, _ = saved
    out = str(tmp_path / "weights")
    assert convert(["from-megatron", "--load", os.path.join(root, "gpt2"), "--save", out, "--no-load-optim"]) == 0
    assert "weights only" in capsys.readouterr().out
    assert not FullCheckpoint(out).has_optimizer()


def test_pretrain_continues_a_megatron_run_with_its_adam_state(saved, tmp_path):
    """``pretrain_gpt.py --load`` of Megatron-LM's folder at TP2, its Adam state read in-process, follows the
    losses of a one-process run loading the ``from-megatron`` import (state included); a fresh optimizer
    (--no-load-optim) gives other losses, so the state is what carries the run; the distributed optimizer's
    dp_reshardable save and its legacy distrib_optim.pt save of the same run, loaded in-process, follow them
    too. (Global batch 8: the mock dataset, sized for 5 iterations, must hold the 14 samples Megatron-LM
    consumed before and 3 more steps.)"""
    from safetensors.torch import load_file

    from tests.asserts import assert_rel_close
    from tests.cli_utils import continue_flags, launch_pretrain, losses

    load = os.path.join(saved[0], "gpt2")
    imported = str(tmp_path / "imported")
    assert convert(["from-megatron", "--load", load, "--save", imported]) == 0
    run = continue_flags(load, 5)
    after = str(tmp_path / "after")
    direct = launch_pretrain([*run, "--load", load, "--tensor-model-parallel-size", "2", "--save", after], nproc=2,
                             timeout=150)
    assert ("as a Megatron-LM checkpoint (with its Adam state; RNG states restored (this run's "
            "tracker/model-parallel-rng kept: another generator kind))") in direct.stdout, direct.stdout[-2000:]
    for rank in range(2):  # no draws with dropout off: what the run saves at its end is what it restored
        saved_rng = load_file(os.path.join(after, "iter_0000005", "rng", f"rank_{rank:05d}.safetensors"))
        assert torch.equal(saved_rng["cpu"], saved[1][rank]["gpt2_rng"]["torch_rng_state"])
    legacy = launch_pretrain([*run, "--load", load + "_legacy", "--tensor-model-parallel-size", "2"], nproc=2,
                             timeout=150)
    assert "(with its Adam state; RNG states restored" in legacy.stdout, legacy.stdout[-2000:]
    got, want = losses(direct), losses(launch_pretrain([*run, "--load", imported], timeout=150))
    fresh = losses(launch_pretrain([*run, "--load", imported, "--no-load-optim"], timeout=150))
    assert sorted(got) == sorted(want) == sorted(fresh) == sorted(losses(legacy)) == [3, 4, 5]
    assert_rel_close([got[i][0] for i in got], [want[i][0] for i in got], 1e-5, "in-process TP2 vs imported TP1")
    assert_rel_close([losses(legacy)[i][0] for i in got], [want[i][0] for i in got], 1e-5, "legacy TP2 vs imported")
    buckets = launch_pretrain([*run, "--load", load + "_dp_reshardable", "--tensor-model-parallel-size", "2"], nproc=2,
                              timeout=150)
    assert "as a Megatron-LM checkpoint (with its Adam state;" in buckets.stdout, buckets.stdout[-2000:]
    assert_rel_close([losses(buckets)[i][0] for i in got], [want[i][0] for i in got], 1e-5, "dp_reshardable --load")
    distrib = launch_pretrain([*run, "--load", load + "_distrib", "--tensor-model-parallel-size", "2"], nproc=2,
                              timeout=150)
    assert "as a Megatron-LM checkpoint (with its Adam state;" in distrib.stdout, distrib.stdout[-2000:]
    assert_rel_close([losses(distrib)[i][0] for i in got], [want[i][0] for i in got], 1e-5, "distrib_optim.pt --load")
    assert abs(fresh[4][0] - want[4][0]) > 1e-4 * abs(want[4][0])  # the imported moments change the next steps


def _cuda_kind() -> torch.Tensor:
    return torch.zeros(16, dtype=torch.uint8)  # a CUDA generator's state: seed and offset


def _restored(folder: str, layout, rank: int, tracker: torch.Tensor | None = None) -> tuple[dict | None, str]:
    """What ``pretrain_gpt.py --load`` of ``folder`` restores on ``rank`` of ``layout`` (a CPU run: its
    device generator is the CPU one; ``tracker``: the tracker's state of another kind, a GPU run's)."""
    from megalite.checkpointing.megatron.read import read_megatron
    from megalite.checkpointing.megatron.rng import rng_to_restore
    from megalite.parallel.groups import ProcessGroups

    src = read_megatron(folder)
    now = {"cpu": torch.get_rng_state(), "device": torch.get_rng_state(),
           "tracker/model-parallel-rng": torch.get_rng_state() if tracker is None else tracker}
    states, note = rng_to_restore(src.rng, src.rng_note, ProcessGroups.unconnected(layout, rank), now)
    if states is not None:
        assert torch.equal(states["device"], states["cpu"])  # on the CPU the device generator is the CPU one
    return states, note


@pytest.mark.parametrize("fmt", ["", "_legacy"])
def test_the_rng_states_are_restored_at_their_layout_only(saved, fmt):
    """Each TP rank's saved RNG states (torch_dist: its ``rng_state`` ShardedObject, unpickled through the
    allow-list; legacy: its file's ``rng_state``) become that rank's: torch's state on a CPU run, the
    CUDA-kind tracker state kept (another generator kind), taken where the run's tracker is of its kind
    (a GPU run's); at another layout nothing is restored and the note says why."""
    from megalite.parallel.layout import RankLayout

    root, ranks = saved
    folder = os.path.join(root, "gpt2" + fmt)
    for rank in range(2):
        want = ranks[rank]["gpt2_rng"]
        states, note = _restored(folder, RankLayout(2, 2, 1), rank)
        assert note == "RNG states restored (this run's tracker/model-parallel-rng kept: another generator kind)"
        assert torch.equal(states["cpu"], want["torch_rng_state"]) and not torch.equal(states["cpu"],
                                                                                        torch.get_rng_state())
        states, note = _restored(folder, RankLayout(2, 2, 1), rank, tracker=_cuda_kind())
        assert note == "RNG states restored", note
        assert torch.equal(states["tracker/model-parallel-rng"], want["rng_tracker_states"]["model-parallel-rng"])
    assert not torch.equal(*(r["gpt2_rng"]["rng_tracker_states"]["model-parallel-rng"] for r in ranks))
    states, note = _restored(folder, RankLayout(1, 1, 1), 0)
    assert states is None and note == "RNG states not restored (saved at TP 2 x PP 1, this run's layout differs)"


def test_torch_dist_rng_states_per_dp_rank(saved_dp2):
    """At TP2 x DP2 each rank restores its own DP rank's state, whether saved per DP rank (shape (PP, TP,
    DP), Megatron-LM 0.16 with expert parallelism) or as DP rank 0's list of all of them (shape (PP, TP));
    at DP1 the per-DP layout is another layout, and the list's first entry is taken (as Megatron-LM does)."""
    from megalite.parallel.layout import RankLayout

    root, ranks = saved_dp2
    for name in NAMES:
        for rank in range(4):
            states, note = _restored(os.path.join(root, name + "_dp2"), RankLayout(4, 2, 1), rank)
            assert note.startswith("RNG states restored"), note
            assert torch.equal(states["cpu"], ranks[rank][name + "_rng"]["torch_rng_state"]), (name, rank)
        assert not torch.equal(ranks[0][name + "_rng"]["torch_rng_state"], ranks[2][name + "_rng"]["torch_rng_state"])
    states, note = _restored(os.path.join(root, "gpt2_dp2"), RankLayout(2, 2, 1), 1)
    assert states is None and note == "RNG states not restored (saved at TP 2 x PP 1 x DP 2, this run's layout differs)"
    states, _ = _restored(os.path.join(root, "llama_dp2"), RankLayout(2, 2, 1), 1)
    assert torch.equal(states["cpu"], ranks[1]["llama_rng"]["torch_rng_state"])


def _te_args(args):
    te = copy.copy(args)
    te.transformer_impl = "transformer_engine"
    return te


@pytest.mark.parametrize("name", NAMES)
def test_dp_reshardable_state_of_the_transformer_engine_spec_imports(saved, name):
    """Transformer Engine's spec lays each layer's parameters out in its own order (the QKV GEMM's fused norm
    after the projection). megatron-core builds that spec only with Transformer Engine, so its buckets are
    this run's real ones moved into that order (tests/megatron_relaid.py); read with the args' transformer_impl,
    they give the same state as the local spec's read (every field exactly) and pass the check that the fp32
    parameters are the weights; read as the local spec they are refused, not read wrong."""
    from megalite.checkpointing.megatron import read as mg
    from megalite.checkpointing.megatron.names import split_optimizer_keys
    from megalite.checkpointing.megatron.torch_dist.dp_optim import _ordered, dp_reshardable_state
    from megalite.checkpointing.megatron.torch_dist.reader import DistCheckpoint
    from tests.megatron_relaid import Relaid

    folder = os.path.join(saved[0], f"{name}_dp_reshardable", f"iter_{STEPS:07d}")
    src = DistCheckpoint(folder)
    keys, _, other = split_optimizer_keys(src.keys())
    te_src, args = Relaid(src, lambda local: _ordered(src, keys, te=True)), src.common["args"]
    expected, step = dp_reshardable_state(src, keys, args)
    got = dp_reshardable_state(te_src, keys, _te_args(args))
    assert not isinstance(got, str), got
    assert got[1] == step and sorted(got[0]) == sorted(expected)
    assert all(torch.equal(got[0][f][n], expected[f][n]) for f in expected for n in expected[f])
    out = mg.read_megatron(os.path.dirname(folder))
    for source, a, read in ((te_src, _te_args(args), True), (te_src, args, False)):
        out.optimizer = None
        mg._dp_reshardable(out, source, keys, other, a, folder)
        assert (out.optimizer is not None) == read, out.optimizer_note


def test_dp_reshardable_state_in_another_order_is_refused_by_the_weights(saved):
    """Two parameters of the same shape, both replicated over TP, swapped in the buffer (GPT-2's input-norm
    bias and projection bias): the buckets still fill exactly and agree between TP ranks, so only the check
    that each fp32 parameter is its saved weight refuses them; the weights still import."""
    from megalite.checkpointing.megatron import read as mg
    from megalite.checkpointing.megatron.names import split_optimizer_keys
    from megalite.checkpointing.megatron.torch_dist.reader import DistCheckpoint
    from tests.megatron_relaid import Relaid

    def swapped(local: list) -> list:
        out, names = list(local), [p[0] for p in local]
        for i, n in enumerate(names):
            if n.endswith("linear_qkv.layer_norm_bias"):
                j = names.index(n.replace("linear_qkv.layer_norm_bias", "linear_proj.bias"))
                out[i], out[j] = out[j], out[i]
        return out

    folder = os.path.join(saved[0], "gpt2_dp_reshardable", f"iter_{STEPS:07d}")
    src = DistCheckpoint(folder)
    keys, _, other = split_optimizer_keys(src.keys())
    out = mg.read_megatron(os.path.dirname(folder))
    out.optimizer = None
    mg._dp_reshardable(out, Relaid(src, swapped), keys, other, src.common["args"], folder)
    assert out.optimizer is None and "is not the saved weight" in out.optimizer_note, out.optimizer_note
    assert out.params


def test_dp_reshardable_state_without_its_fp32_parameters_is_refused(saved):
    """Buffers without the ``param`` field (the fp32 main parameters) cannot be checked against the weights:
    refused with the reason, not read unchecked."""
    from megalite.checkpointing.megatron.names import split_optimizer_keys
    from megalite.checkpointing.megatron.torch_dist.dp_optim import dp_reshardable_state
    from megalite.checkpointing.megatron.torch_dist.reader import DistCheckpoint

    src = DistCheckpoint(os.path.join(saved[0], "gpt2_dp_reshardable", f"iter_{STEPS:07d}"))

    class WithoutParams:
        def keys(self):
            return [k for k in src.keys() if not k.endswith(".param")]

        def __getattr__(self, name):
            return getattr(src, name)

    got = dp_reshardable_state(WithoutParams(), split_optimizer_keys(src.keys())[0], src.common["args"])
    assert isinstance(got, str) and "not param, exp_avg and exp_avg_sq" in got, got
