"""Promise (docs/parallelism.md, "Uneven pipeline stages"): Megatron-LM's split flags place the layers as
Megatron-LM does, with ZB-V's V taking the first/last counts on its first and last virtual stages; one
placement rule (parallel/placement.py) serves the model, the checkpoints and the planner; every broken rule
is one line through pretrain_gpt.py naming the flags, before any work. Training and checkpoints on real
ranks: tests/test_uneven_training.py."""

from __future__ import annotations

import pytest

from megalite.config.arguments import MegaliteConfig
from megalite.parallel.placement import LayerSplit
from megalite.parallel.stage_layout import parse_layout
from tests.test_bad_input_config import _entry, run_main
from tests.tp_utils import LLAMA_GQA, layout_flat

pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")


def split_of(num_layers: int, pp: int, **flags) -> LayerSplit:
    return MegaliteConfig.from_flat(layout_flat({**LLAMA_GQA, "num_layers": num_layers}, vocab=64, iters=1, pp=pp,
                                                **flags)).parallel.layer_split(num_layers)


@pytest.mark.parametrize("num_layers,pp,flags,counts", [
    (10, 4, {"decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 3}, (1, 3, 3, 3)),
    (10, 4, {"decoder_first_pipeline_num_layers": 4}, (4, 2, 2, 2)),
    (7, 4, {"decoder_last_pipeline_num_layers": 1}, (2, 2, 2, 1)),
    (7, 4, {"account_for_loss_in_pipeline_split": True}, (2, 2, 2, 1)),
    (6, 4, {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True},
     (1, 2, 2, 1)),
    # interleaved: rank 0's 2 layers are 1 per chunk, pipeline order chunk 0 of every rank then chunk 1
    (10, 2, {"num_virtual_stages_per_pipeline_rank": 2, "decoder_first_pipeline_num_layers": 2}, (1, 4, 1, 4)),
    (8, 2, {"num_virtual_stages_per_pipeline_rank": 2}, (2, 2, 2, 2)),
    # ZB-V: the counts are the V's first and last virtual stages (rank 0's chunks 0 and 1)
    (10, 2, {"pipeline_schedule": "zbv", "decoder_first_pipeline_num_layers": 1,
             "decoder_last_pipeline_num_layers": 3}, (1, 3, 3, 3)),
    (10, 4, {"pipeline_model_parallel_layout": "E|t*4|ttt|t*3L"}, (0, 4, 3, 3)),
    (10, 2, {"pipeline_model_parallel_layout": "Et|(ttt|)*2,tttL"}, (1, 3, 3, 3)),
])
def test_counts_follow_megatron(num_layers, pp, flags, counts):
    split = split_of(num_layers, pp, **flags)
    assert split.errors() == [] and split.counts == counts
    every = sorted(i for r in range(pp) for i in split.rank_layers(r))
    assert every == list(range(num_layers)), "every layer once"


def test_v_places_the_first_and_last_counts_on_rank_0():
    split = split_of(10, 2, pipeline_schedule="zbv", decoder_first_pipeline_num_layers=1,
                     decoder_last_pipeline_num_layers=3)
    assert split.rank_chunks(0) == [[0], [7, 8, 9]] and split.rank_chunks(1) == [[1, 2, 3], [4, 5, 6]]
    interleaved = split_of(10, 2, num_virtual_stages_per_pipeline_rank=2, decoder_first_pipeline_num_layers=2)
    assert interleaved.rank_chunks(0) == [[0], [5]] and interleaved.rank_chunks(1) == [[1, 2, 3, 4], [6, 7, 8, 9]]


@pytest.mark.parametrize("text,expected", [
    ("E|t*3|t*3|tL", (0, 3, 3, 1)), ("E,t|(tt|)*2,t|L", (1, 2, 2, 1, 0)), ("Et||tL", (1, 0, 1)),
])
def test_layout_strings_parse(text, expected):
    assert parse_layout(text) == expected


# (extra flags, text the one-line message must hold); 10 layers unless given
SPLIT_CASES = {
    "middle not divisible": (["--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "2",
                              "--decoder-last-pipeline-num-layers", "3"],
                             "the remaining 5 of --num-layers (10) must split evenly over the 2 other virtual"),
    "counts exceed": (["--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "8",
                       "--decoder-last-pipeline-num-layers", "3"], "(11 layers) exceed --num-layers (10)"),
    "two stages must add up": (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3",
                                "--decoder-last-pipeline-num-layers", "3"],
                               "--decoder-first-pipeline-num-layers + --decoder-last-pipeline-num-layers (6) must "
                               "equal --num-layers (10)"),
    "account with first": (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3",
                            "--account-for-loss-in-pipeline-split"],
                           "--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split and "
                           "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers are exclusive"),
    "account not divisible": (["--pipeline-model-parallel-size", "4", "--account-for-embedding-in-pipeline-split"],
                              "--num-layers (10) + 1 must be divisible by the 4 virtual pipeline stages"),
    "first needs pp": (["--decoder-first-pipeline-num-layers", "3"],
                       "--decoder-first-pipeline-num-layers needs --pipeline-model-parallel-size > 1"),
    "first over vp": (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                       "--decoder-first-pipeline-num-layers", "3"],
                      "--decoder-first-pipeline-num-layers (3) must be divisible by "
                      "--num-virtual-stages-per-pipeline-rank (2)"),
    "layers per vstage beside first": (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-"
                                        "stage", "1", "--decoder-first-pipeline-num-layers", "2"],
                                       "need --num-virtual-stages-per-pipeline-rank, not "
                                       "--num-layers-per-virtual-pipeline-stage"),
    "both vp flags": (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                       "--num-virtual-stages-per-pipeline-rank", "2"],
                      "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank are "
                      "exclusive"),
    "vstages not dividing": (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "3"],
                             "--num-layers (10) must be divisible by --pipeline-model-parallel-size (2) x "
                             "--num-virtual-stages-per-pipeline-rank (3)"),
    "layout with first": (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et*5|t*5L",
                           "--decoder-first-pipeline-num-layers", "5"],
                          "--pipeline-model-parallel-layout sets every stage's layers itself; drop "
                          "--decoder-first-pipeline-num-layers"),
    "layout mtp": (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et*5|t*5,m|L"],
                   "m (an MTP layer) is not supported"),
    "layout count": (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et*5|t*4L"],
                     "--pipeline-model-parallel-layout holds 9 transformer layers (t), --num-layers is 10"),
    "layout stages": (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et*5|t*4|tL"],
                      "--pipeline-model-parallel-layout has 3 stages; it needs a multiple of "
                      "--pipeline-model-parallel-size (2)"),
    "layout embedding": (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "t*5|Et*5L"],
                         "the embedding E must open the first stage, once"),
    "layout symbol": (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et*5|x*5L"],
                      "unknown symbol 'x'"),
    "empty middle stage": (["--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-layout",
                            "Et*5||t*4|tL"], "virtual stage 1 would hold no layer"),
    "zbv layout": (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
                    "--pipeline-model-parallel-layout", "Et*5|t*5L"],
                   "has 2 stages; it needs 2 x --pipeline-model-parallel-size (4) under ZB-V's V"),
    "zbv vstages": (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
                     "--num-virtual-stages-per-pipeline-rank", "2"],
                    "--pipeline-schedule zbv places its own model chunks (two per rank); drop "
                    "--num-virtual-stages-per-pipeline-rank"),
    "layout needs pp": (["--pipeline-model-parallel-layout", "Et*5|t*5L"],
                        "--pipeline-model-parallel-layout needs --pipeline-model-parallel-size > 1"),
    "zbh1 layout chunks": (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1",
                            "--pipeline-model-parallel-layout", "Et*2|t*3|t*2|t*3L"],
                           "--pipeline-schedule zb-h1 runs one model chunk per rank"),
    "negative first": (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "-1"],
                       "--decoder-first-pipeline-num-layers must be an integer in [0, "),
}


@pytest.fixture(scope="module")
def entry():
    return _entry()


@pytest.mark.parametrize("case", sorted(SPLIT_CASES))
def test_bad_split_is_one_line_naming_the_flags(entry, monkeypatch, capsys, case):
    extra, expected = SPLIT_CASES[case]
    argv = ["--mock-data", "--vocab-size", "64", "--train-iters", "2", "--num-layers", "10", "--hidden-size", "16",
            "--num-attention-heads", "2", "--seq-length", "8", *extra]
    rc, err = run_main(entry, monkeypatch, capsys, argv)
    assert rc not in (0, None), err
    assert "Traceback" not in err
    assert any(expected in line for line in err.splitlines()), err


def test_planner_reads_the_split():
    """The planner's per-rank layers, parameters and activations follow the split the model builds, and an
    uneven split's compute is paced by its busiest rank; --search proposes the loss counted as a layer
    and first/last counts."""
    from megalite.planning.hardware import ClusterConfig
    from megalite.planning.kernels import stage_compute_s
    from megalite.planning.memory import peak_memory, stage_dense_params, stage_layer_bytes
    from megalite.planning.search import pipeline_splits
    from megalite.planning.shape import RunShape

    def shape(**flags) -> RunShape:
        cfg = MegaliteConfig.from_flat(layout_flat({**LLAMA_GQA, "num_layers": 10}, vocab=64, iters=1, pp=4, **flags))
        return RunShape.of(cfg, 4, 64)

    uneven = shape(decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=3)
    assert [uneven.layers_in(r) for r in range(4)] == [1, 3, 3, 3] and uneven.layers_per_stage == 3
    assert stage_layer_bytes(uneven, 1) == 3 * stage_layer_bytes(uneven, 0)
    assert stage_dense_params(uneven, 1) > stage_dense_params(uneven, 0)
    cl = ClusterConfig()
    even = shape(pipeline_model_parallel_size=2)  # 5 layers a rank
    assert stage_compute_s(uneven, cl) < stage_compute_s(even, cl)
    assert peak_memory(uneven).stage == 1  # three layers and 1F1B's p - 1 micro-batches in flight
    worse = shape(decoder_first_pipeline_num_layers=4)  # 4, 2, 2, 2: the first rank paces it
    assert stage_compute_s(worse, cl) > stage_compute_s(uneven, cl)
    splits = pipeline_splits(7)
    assert (4, True, None, None) in splits and (4, False, None, None) not in splits
    assert (4, False, None, 1) in splits  # the first/last counts (tests/test_planning_pipeline.py)


def test_resume_restores_rng_only_where_the_rank_holds_the_same_layers():
    """A checkpoint's chunk_layers say which layers each rank held: the same sizes with another split (or
    round-robin against a V) is another layout, whose RNG states are not restored; a checkpoint without
    them (written before uneven splits existed) was even and round-robin."""
    from types import SimpleNamespace

    from megalite.checkpointing.load import _same_layers

    def chunk(*layers: int) -> SimpleNamespace:
        return SimpleNamespace(layers={str(i): None for i in layers})

    rank1 = SimpleNamespace(pp_rank=1)
    uneven = {"pp": 4, "vp": 1, "chunk_layers": [[[0]], [[1, 2, 3]], [[4, 5]], [[6, 7]]]}
    assert _same_layers(uneven, [chunk(1, 2, 3)], rank1, {"num_layers": 8})
    assert not _same_layers(uneven, [chunk(2, 3)], rank1, {"num_layers": 8})
    older = {"pp": 4, "vp": 1}
    assert _same_layers(older, [chunk(2, 3)], rank1, {"num_layers": 8})
    assert not _same_layers(older, [chunk(1, 2, 3)], rank1, {"num_layers": 8})


def test_reshard_tool_writes_and_names_uneven_splits(tmp_path):
    """convert_checkpoint.py reshard takes pretrain_gpt.py's split flags (ZB-V's V included): the files it
    writes record each rank's layers and hold the same tensors; a split the model cannot take is named."""
    import json

    import torch

    from megalite.checkpointing.full_reader import FullCheckpoint
    from megalite.checkpointing.metadata import config_dict
    from megalite.checkpointing.stored import named_params
    from megalite.checkpointing.writer import write_checkpoint
    from megalite.config.model import ModelConfig
    from megalite.model.gpt import GPTModel
    from megalite.parallel.groups import ProcessGroups
    from megalite.tensor_parallel.context import BuildContext
    from megalite.tensor_parallel.random import RNGTracker
    from tests.cli_utils import load_tool

    cfg = ModelConfig(**{**LLAMA_GQA, "num_layers": 6, "hidden_size": 32})
    model = GPTModel(cfg, BuildContext(ProcessGroups.single(), RNGTracker()), 64)
    gen = torch.Generator().manual_seed(0)
    full = {k: torch.randn(p.shape, generator=gen) for n, k, p in named_params([model]) if n == k}
    write_checkpoint(str(tmp_path / "src"), config_dict(cfg, 64), full.__getitem__, tp=1, pp=1)
    main = load_tool("convert_checkpoint").main
    assert main(["reshard", "--load", str(tmp_path / "src"), "--save", str(tmp_path / "v"),
                 "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
                 "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1"]) == 0
    layout = json.load(open(tmp_path / "v" / "iter_0000000" / "metadata.json"))["layout"]
    assert layout["chunk_layers"] == [[[0], [5]], [[1, 2], [3, 4]]]
    src, back = FullCheckpoint(str(tmp_path / "src")), FullCheckpoint(str(tmp_path / "v"))
    assert all(torch.equal(back.param(k), src.param(k)) for k in src.keys())
    assert main(["reshard", "--load", str(tmp_path / "v"), "--save", str(tmp_path / "bad"),
                 "--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "2",
                 "--decoder-last-pipeline-num-layers", "1"]) != 0
