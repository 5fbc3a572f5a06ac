"""Promise: every MoE rule of config/validate_moe.py (moe_errors, expert_layout_errors) refuses a bad combination
before any process group exists, naming the flags and the rule; the combinations the code does not
support (ZeRO-3, hierarchical DP reduction over expert-data-parallel groups, padding with the allgather
dispatcher) are refused by name. Bad MoE input through pretrain_gpt.py itself: tests/
test_bad_inputs_entry_points.py."""

from __future__ import annotations

import pytest

from megalite.config import ConfigError, parse_args, validate

BASE = ["--mock-data", "--vocab-size", "1000", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads",
        "8", "--seq-length", "32", "--micro-batch-size", "2"]
MOE = ["--num-experts", "4", "--disable-bias-linear"]


def check(extra: list[str], world: int = 1, local_world: int | None = None):
    cfg = parse_args(BASE + extra)
    validate(cfg, world, local_world)
    return cfg


@pytest.mark.parametrize("extra,world", [
    (MOE, 1),
    ([*MOE, "--expert-model-parallel-size", "4"], 4),
    ([*MOE, "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 4),
    ([*MOE, "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
      "--expert-tensor-parallel-size", "1"], 4),
    ([*MOE, "--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity",
      "--moe-token-dispatcher-type", "alltoall"], 1),
    ([*MOE, "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"], 1),
    ([*MOE, "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate"], 1),
    ([*MOE, "--moe-layer-freq", "([0]*1+[1]*3)"], 1),
    ([*MOE, "--expert-model-parallel-size", "2", "--data-parallel-sharding-strategy", "optim_grads"], 4),
    # ZeRO-3: expert weights sharded over expert-DP, dense ones over DP x CP (their ParamMeta families)
    ([*MOE, "--expert-model-parallel-size", "2", "--data-parallel-sharding-strategy", "optim_grads_params"], 4),
    ([*MOE, "--expert-model-parallel-size", "2", "--use-megatron-fsdp"], 2),
    ([*MOE, "--hierarchical-dp-reduce"], 4),  # EP 1: expert-DP is the dense DP group
    ([*MOE, "--expert-model-parallel-size", "2", "--grad-compression", "int8"], 2),
], ids=lambda x: " ".join(x) if isinstance(x, list) else str(x))
def test_valid_moe_configs(extra, world):
    check(extra, world, 2 if "--hierarchical-dp-reduce" in extra else None)


@pytest.mark.parametrize("extra,world,fragments", [
    # the layout sizes
    ([*MOE, "--expert-model-parallel-size", "0"], 1, ["--expert-model-parallel-size must be an integer in [1, ",
         "got 0"]),
    # a dense model
    (["--num-experts", "0", "--disable-bias-linear"], 1, ["--num-experts must be an integer in [1, 67108864], got 0"]),
    (["--expert-model-parallel-size", "2"], 2, ["--expert-model-parallel-size", "need --num-experts"]),
    (["--expert-tensor-parallel-size", "2"], 2, ["--expert-tensor-parallel-size need --num-experts"]),
    # the MoE flags
    ([*MOE, "--moe-router-topk", "5"], 1, ["--moe-router-topk (5) must be between 1 and --num-experts (4)"]),
    ([*MOE, "--moe-router-topk", "0"], 1, ["--moe-router-topk must be an integer in [1, 67108864], got 0"]),
    ([*MOE, "--expert-model-parallel-size", "3"], 3, ["--expert-model-parallel-size (3) must divide --num-experts"]),
    ([*MOE, "--moe-ffn-hidden-size", "6", "--expert-tensor-parallel-size", "4"], 4,
     ["--expert-tensor-parallel-size (4) must divide the expert hidden size (--moe-ffn-hidden-size 6)"]),
    ([*MOE, "--moe-layer-freq", "[1,1]"], 1, ["--moe-layer-freq '[1,1]' must give 0 or 1 for each of the 4 layers"]),
    ([*MOE, "--moe-layer-freq", "x"], 1, ["--moe-layer-freq 'x' is neither an integer nor a list"]),
    (["--num-experts", "4"], 1, ["--num-experts needs --disable-bias-linear"]),
    ([*MOE, "--tensor-model-parallel-size", "2"], 2, ["--tensor-model-parallel-size > 1 needs --sequence-parallel"]),
    ([*MOE, "--use-tp-pp-dp-mapping"], 1, ["needs the default --rank-order tp-cp-dp-pp"]),
    ([*MOE, "--rank-order", "tp-cp-pp-dp"], 1, ["needs the default --rank-order tp-cp-dp-pp"]),
    ([*MOE, "--moe-expert-capacity-factor", "0"], 1, ["--moe-expert-capacity-factor must be a finite number in (0, ",
         "got 0.0"]),
    ([*MOE, "--moe-pad-expert-input-to-capacity", "--moe-token-dispatcher-type", "alltoall"], 1,
     ["--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"]),
    ([*MOE, "--moe-pad-expert-input-to-capacity", "--moe-expert-capacity-factor", "1"], 1,
     ["--moe-pad-expert-input-to-capacity needs --moe-token-dispatcher-type alltoall"]),
    ([*MOE, "--moe-router-enable-expert-bias"], 1,
     ["--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"]),
    ([*MOE, "--moe-router-pre-softmax", "--moe-router-score-function", "sigmoid"], 1,
     ["--moe-router-pre-softmax needs --moe-router-score-function softmax"]),
    ([*MOE, "--moe-aux-loss-coeff", "-1"], 1,
         ["--moe-aux-loss-coeff must be a finite number > 0, or 0 (0 is not computed)"]),
    ([*MOE, "--moe-z-loss-coeff", "-0.1"], 1,
         ["--moe-z-loss-coeff must be a finite number > 0, or 0 (0 is off, as None)"]),
    ([*MOE, "--moe-router-bias-update-rate", "-0.1"], 1, ["--moe-router-bias-update-rate must be", ">= 0, got -0.1"]),
    ([*MOE, "--moe-shared-expert-gate"], 1, ["--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size"]),
    ([*MOE, "--moe-shared-expert-intermediate-size", "30", "--tensor-model-parallel-size", "4",
      "--sequence-parallel"], 4, ["--tensor-model-parallel-size (4) must divide --moe-shared-expert-intermediate-size "
                                  "(30)"]),
    # what the code does not support with routed experts
    ([*MOE, "--expert-model-parallel-size", "2", "--hierarchical-dp-reduce"], 4,
     ["--hierarchical-dp-reduce is not supported with --expert-model-parallel-size > 1"]),
    ([*MOE, "--expert-tensor-parallel-size", "2", "--hierarchical-dp-reduce"], 4,
     ["--expert-tensor-parallel-size != --tensor-model-parallel-size"]),
    # expert_layout_errors: EP x expert-TP must divide a stage's ranks
    ([*MOE, "--expert-model-parallel-size", "4"], 6,
     ["--expert-model-parallel-size (4) x --expert-tensor-parallel-size (1) must divide the ranks of a pipeline "
      "stage (6 = TP 1 x CP 1 x DP 6)"]),
    ([*MOE, "--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 2,
     ["must divide the ranks of a pipeline stage (1 = TP 1 x CP 1 x DP 1)"]),
], ids=lambda x: " ".join(x) if isinstance(x, list) else str(x))
def test_invalid_moe_combination_names_flags_and_rule(extra, world, fragments):
    with pytest.raises(ConfigError) as err:
        check(extra, world, 2 if "--hierarchical-dp-reduce" in extra else None)
    for f in fragments:
        assert f in str(err.value), f"{f!r} not in {err.value}"
