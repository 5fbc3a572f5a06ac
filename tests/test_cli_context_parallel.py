"""Promise, through pretrain_gpt.py's entry point on real ranks (the CP2 save through torchrun itself): with
--context-parallel-size the logged lm loss and grad norm of 5 iterations equal the single-process run's
(relative 1e-5) for CP4 (GPT-2), CP2 x TP2 with sequence parallelism and CP2 x PP2 interleaved (Llama GQA),
CP2 x DP2 with the distributed optimizer (GPT-2), Llama with 2 KV groups on packed documents at CP4 a2a+p2p
(2 x 2); a checkpoint saved at one CP size resumes at another on
the same curve; bf16 follows the bf16 single-process run. Every CP layout of both models trains in-process
against the single-process run in tests/test_context_parallel_training.py (the same code below the flags);
here each CP flag combination goes through the command line once."""

from __future__ import annotations

import pytest

from tests.asserts import assert_rel_close
from tests.cli_utils import assert_same_log_curves, launch_pretrain, losses, run_pretrain, serial_losses

ITERS = 5
COMMON = ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", str(ITERS), "--lr", "1e-3",
          "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--hidden-dropout", "0",
          "--attention-dropout", "0", "--log-interval", "1", "--seed", "1234", "--eval-iters", "0"]
MODELS = {
    "gpt2": ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
             "--max-position-embeddings", "64"],
    "llama": ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
              "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
              "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
              "--disable-bias-linear"],
}
LAYOUTS = {
    "cp4": (["--context-parallel-size", "4"], 4),
    "cp2_tp2_sp": (["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 4),
    "cp2_pp2_interleaved": (["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                             "--num-layers-per-virtual-pipeline-stage", "1"], 4),
    "cp2_dp2_distopt": (["--context-parallel-size", "2", "--use-distributed-optimizer"], 4),
}
def serial(model: str) -> dict:
    return serial_losses(COMMON + MODELS[model])


CASES = [("gpt2", "cp4"), ("llama", "cp2_tp2_sp"), ("llama", "cp2_pp2_interleaved"), ("gpt2", "cp2_dp2_distopt")]


@pytest.mark.parametrize("model,layout", CASES)
def test_entry_point_context_parallel_matches_single_process(model, layout):
    flags, nproc = LAYOUTS[layout]
    got = losses(launch_pretrain(COMMON + MODELS[model] + flags, nproc=nproc))
    assert_same_log_curves(got, serial(model), range(1, ITERS + 1), f"{model} {layout}")


PACKED = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]


def test_entry_point_packed_documents_at_cp4_a2a_p2p_match_single_process():
    """Llama GQA with 2 KV groups at CP 4 through a2a+p2p (2 x 2), Megatron's packed-document flags on."""
    flags = ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes",
             "2", "2"]
    got = losses(launch_pretrain(COMMON + MODELS["llama"] + PACKED + flags, nproc=4))
    assert_same_log_curves(got, serial_losses(COMMON + MODELS["llama"] + PACKED), range(1, ITERS + 1),
                           "llama packed cp4 a2a+p2p")


def test_checkpoint_saved_at_cp2_resumes_at_cp4_and_cp1(tmp_path):
    """Save at CP2 x DP2 (distributed optimizer: its state sharded over DP x CP) at iteration 3, resume at
    CP4 and at one rank: iterations 4-5 continue the single-process curve."""
    ck = str(tmp_path / "ck")
    base = COMMON + MODELS["llama"]
    first = base + ["--save", ck, "--save-interval", "3", "--exit-interval", "3"]
    losses(run_pretrain(first + ["--context-parallel-size", "2", "--use-distributed-optimizer"], nproc=4))
    ref = serial("llama")
    for flags, nproc in ((["--context-parallel-size", "4", "--use-distributed-optimizer"], 4), ([], 1)):
        got = losses(launch_pretrain(base + ["--load", ck, *flags], nproc=nproc))
        assert_same_log_curves(got, ref, range(4, ITERS + 1), f"resume {flags or 'serial'}")


def test_bf16_ring_and_a2a_follow_the_bf16_single_process_run():
    """bf16 at CP2, ring and all-to-all: loss and grad norm follow the bf16 single-process run within bf16's
    rounding (relative 1e-2 and 5e-2; fp32 equality of every CP layout: above and in
    tests/test_context_parallel_training.py)."""
    base = COMMON + MODELS["gpt2"] + ["--bf16"]
    ref = serial_losses(base)
    its = sorted(ref)
    for comm in ("p2p", "a2a"):
        got = losses(launch_pretrain(base + ["--context-parallel-size", "2", "--cp-comm-type", comm], nproc=2))
        assert sorted(got) == its
        assert_rel_close([got[i][0] for i in its], [ref[i][0] for i in its], 1e-2, f"bf16 {comm} lm loss")
        assert_rel_close([got[i][1] for i in its], [ref[i][1] for i in its], 5e-2, f"bf16 {comm} grad norm")
