"""The golden curves: loss and grad norm of three fixed runs, recorded from the code and checked by
tests/golden/test_golden.py so that a change which alters the numbers is seen.

Re-record (only when a change is meant to alter the numbers, and say so in the commit):

    PYTHONPATH=$PWD python tests/golden/record.py

The runs go through the command-line parser, validation and pretrain() in-process (the values come
back at full precision, not rounded as in the log line), on two real ranks over gloo.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megalite.config import parse_args, validate  # noqa: E402
from megalite.training.loop import pretrain  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.tp_utils import groups_for  # noqa: E402

CURVES = Path(__file__).with_name("curves.json")
# The torch release the curves were recorded on: the runs keep dropout on, and dropout's random stream
# (CPU bernoulli) differs between releases, so the curves hold on that release only.
RECORDED_ON = "recorded_on_torch"
WORLD = 2
COMMON = ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "6", "--lr", "3e-3",
          "--lr-warmup-iters", "2", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "250",
          "--seq-length", "16", "--max-position-embeddings", "16", "--log-interval", "100", "--eval-iters", "0",
          "--seed", "1234"]
GPT2 = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4"]
LLAMA_GQA = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "8", "--group-query-attention",
             "--num-query-groups", "2", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
             "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
# name -> (flags, relative tolerance of the check); every run uses both ranks.
RUNS = {
    "gpt2_fp32_pp2_interleaved": (
        GPT2 + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"], 1e-6),
    "llama_gqa_fp32_tp2_sp": (
        LLAMA_GQA + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 1e-6),
    "llama_bf16_dp2_distopt": (
        LLAMA_GQA + ["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
        1e-3),
}


def _run_all(rank: int, world: int) -> dict[str, dict[str, list]]:
    out = {}
    for name, (flags, _) in RUNS.items():
        cfg = parse_args(COMMON + flags)
        validate(cfg, world)
        p = cfg.parallel
        pg = groups_for(world, rank, p.tensor_model_parallel_size, p.pipeline_model_parallel_size)
        res = pretrain(cfg, pg, log=lambda s: None)
        out[name] = {"loss": res.losses, "grad_norm": res.grad_norms}
    return out


def run() -> dict[str, dict[str, list]]:
    """The curves as the last rank sees them (it holds the loss, as in the log line)."""
    return run_ranks(_run_all, WORLD, timeout=400)[-1]


if __name__ == "__main__":
    import torch

    from tests.golden import record  # the ranks import the functions from the package, not __main__

    curves = record.run()
    runs = {name: {"flags": " ".join(COMMON + RUNS[name][0]), **c} for name, c in curves.items()}
    CURVES.write_text(json.dumps({RECORDED_ON: torch.__version__.split("+")[0], **runs}, indent=1) + "\n")
    print(f"wrote {CURVES}")
