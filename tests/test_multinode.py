"""Promise, as a real two-node job on one machine: two `torchrun --nnodes 2 --node-rank {0,1}
--nproc-per-node 2` launches meeting at a c10d rendezvous on the loopback interface (4 ranks) train a
TP=2 x DP=2 GPT whose printed layout keeps every TP group on one node, whose ranks really run where the
layout says (each launch is a node), and whose lm loss equals the single-process run's within 1e-5.
The launch examples (single node, multi-node torchrun, Slurm) are valid runs; the single-node one trains."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time

import pytest

from megalite.config import parse_args, validate
from tests.asserts import assert_rel_close
from tests.cli_utils import LOSS, ROOT, launch_pretrain, losses
from tests.harness import free_port

ITERS = 4
ARGS = ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", str(ITERS), "--lr", "1e-3",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--log-interval", "1", "--seed", "1234", "--eval-iters", "0",
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32"]
LAYOUT = ["--tensor-model-parallel-size", "2", "--hierarchical-dp-reduce", "--print-layout"]


def _launch_two_nodes(args: list[str], timeout: float = 240) -> tuple[str, list[str]]:
    """Start both "nodes", wait for both; return (combined stdout, each launch's stderr)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", f"megalite-test-{port}", "--rdzv-conf", "join_timeout=60", "--max-restarts", "0",
               str(ROOT / "pretrain_gpt.py"), *args]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for p in procs:  # one node failing must not leave the other waiting at the rendezvous
            if p.poll() is None:
                p.kill()
                p.communicate()
    for node, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {node} exited {p.returncode}:\n{out[-3000:]}\n{err[-5000:]}"
    return "".join(o for o, _ in outs), [e for _, e in outs]


def test_two_node_loopback_tp2_trains_with_tp_inside_nodes():
    t0 = time.monotonic()
    stdout, _ = _launch_two_nodes(ARGS + LAYOUT)
    elapsed = time.monotonic() - t0
    ref = losses(launch_pretrain(ARGS))

    # The printed layout: 2 nodes x 2 ranks, each TP group on one node, no warning, placement confirmed.
    assert "world 4 = tp 2 x dp 2 x pp 1" in stdout and "2 node(s) x 2 ranks" in stdout
    tp_lines = re.findall(r"^    ranks \[([\d, ]+)\] on (node \d+|nodes \[[\d, ]+\])", stdout.split("tp groups")[1]
                          .split("dp groups")[0], flags=re.M)
    assert [(g, where) for g, where in tp_lines] == [("0, 1", "node 0"), ("2, 3", "node 1")]
    assert "ranks per node checked against where each rank runs: ok" in stdout
    assert "WARNING" not in stdout and "crosses nodes" not in stdout

    got = {int(m[1]): float(m[2]) for m in LOSS.finditer(stdout)}
    assert sorted(got) == sorted(ref) == list(range(1, ITERS + 1))
    assert_rel_close([got[it] for it in sorted(ref)], [ref[it][0] for it in sorted(ref)], 1e-5,
                     "lm loss per iteration, two nodes vs serial")
    print(f"two-node launch: {elapsed:.1f} s")


# ---- the launch examples -------------------------------------------------------------------------
def _example(script: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "examples" / script)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240, env={**os.environ, **env})


@pytest.mark.parametrize("script,env,world,per_node", [
    ("pretrain_gpt_single_node.sh", {}, 8, 8),
    ("pretrain_gpt_multi_node.sh", {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "node0"}, 16, 8),
    ("pretrain_gpt_slurm.sbatch", {"LAUNCHER": "srun", "SLURM_NNODES": "2", "MASTER_ADDR": "node0"}, 16, 8),
    ("pretrain_deepseek_v3_small.sh", {}, 8, 8),
])
def test_example_commands_are_valid_runs(script, env, world, per_node):
    """Every example's pretrain_gpt.py flags parse and pass validation for the world it is written for."""
    out = _example(script, {"DRY_RUN": "1", **env})
    assert out.returncode == 0, out.stderr
    words = shlex.split(out.stdout)
    args = words[words.index("pretrain_gpt.py") + 1:]
    cfg = parse_args(args)
    validate(cfg, world, local_world_size=per_node)
    assert cfg.parallel.print_layout and cfg.checkpoint.save == cfg.checkpoint.load


def test_slurm_example_starts_one_torchrun_per_node():
    out = _example("pretrain_gpt_slurm.sbatch", {"DRY_RUN": "1", "SLURM_NNODES": "2", "SLURM_JOB_ID": "42",
                                                 "MASTER_ADDR": "node0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c exec torchrun --nnodes 2")
    assert "--node-rank $SLURM_NODEID" in out.stdout and "--rdzv-endpoint node0:29500 --rdzv-id 42" in out.stdout


def test_single_node_example_trains_on_cpu(tmp_path):
    tiny = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "2",
            "--train-iters", "3", "--log-interval", "1", "--eval-iters", "0", "--vocab-size", "1000"]
    out = subprocess.run(["bash", str(ROOT / "examples" / "pretrain_gpt_single_node.sh"), *tiny], cwd=ROOT,
                         capture_output=True, text=True, timeout=240,
                         env={**os.environ, "NPROC": "2", "PRECISION": "", "CKPT": str(tmp_path / "ckpt"),
                              "TORCHRUN": f"{sys.executable} -m torch.distributed.run", "OMP_NUM_THREADS": "1"})
    assert sorted(losses(out)) == [1, 2, 3]
    assert "tp groups: 1 of 2 ranks" in out.stdout and (tmp_path / "ckpt").is_dir()
