"""Context parallelism in training (docs/parallelism.md, "Context parallelism in training"), on 4 gloo
ranks (tests/harness.py), mock data, fp32, a small Llama-style GPT (GQA):

1. bytes per step: ``ProcessGroups.comm_bytes`` of the "cp" axis over the steps of a real ``pretrain()``
   run at c = 2 and 4 for each --cp-comm-type, against layers x micro-batches x the per-layer formula of
   docs/parallelism.md (checked exactly), and the gradient reduction over dp_cp (one buffer per step);
2. activation bytes per rank: the bytes autograd saves for backward over one micro-batch's forward (all
   layers and the loss; parameters and views of them excluded), c = 2 and 4 over serial (c = 1);
3. the longest sequence whose saved activations per rank fit a fixed cap (CAP_MB), at c = 1, 2, 4
   (the sequence doubles from 512 until the next would exceed the cap), then one real training step at
   that length (its loss must be finite);
4. step time at c = 4: the median of timed steps of ring (p2p), a2a and allgather, run in alternation
   in the same processes so the machine's load touches each alike; ratios to the ring.

    OMP_NUM_THREADS=1 python bench/bench_context_parallel.py     # a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.config import validate  # noqa: E402
from megalite.config.arguments import MegaliteConfig  # noqa: E402
from megalite.model.activation_memory import saved_bytes  # noqa: E402
from megalite.model.build import build_model  # noqa: E402
from megalite.model.forward_step import lm_forward_step  # noqa: E402
from megalite.parallel.groups import ProcessGroups  # noqa: E402
from megalite.parallel.layout import RankLayout  # noqa: E402
from megalite.tensor_parallel.random import model_parallel_seed  # noqa: E402
from megalite.training.batches import context_parallel_part  # noqa: E402
from megalite.training.loop import pretrain  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.tp_utils import mock_data  # noqa: E402

WORLD = 4
VOCAB = 512
MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=8, group_query_attention=True, num_query_groups=4,
             position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             untie_embeddings_and_output_weights=True, disable_bias_linear=True, hidden_dropout=0.0,
             attention_dropout=0.0)
COMMS = ("p2p", "a2a", "allgather")
CAP_MB = 24.0
QUIET = lambda s: None  # noqa: E731


def make_cfg(seq: int, cp: int, comm: str = "p2p", iters: int = 2, m: int = 2) -> MegaliteConfig:
    """Micro-batch 1, m micro-batches per DP rank and step."""
    dp = WORLD // cp
    cfg = MegaliteConfig.from_flat(dict(
        MODEL, seq_length=seq, max_position_embeddings=seq, micro_batch_size=1, global_batch_size=dp * m,
        train_iters=iters, lr=1e-4, log_interval=1, eval_iters=0, eval_interval=10_000, mock_data=True,
        vocab_size=VOCAB, seed=1234, context_parallel_size=cp, cp_comm_type=comm))
    validate(cfg, WORLD)
    return cfg


def cp_formula(comm: str, c: int, s: int, layers: int, m: int) -> int:
    """docs/parallelism.md's per-layer, per-micro-batch bytes (forward + backward), x layers x micro-batches."""
    b, e, d = 1, 4, MODEL["hidden_size"] // MODEL["num_attention_heads"]
    nq, nkv, sl = MODEL["num_attention_heads"], MODEL["num_query_groups"], s // c
    kv = 2 * b * nkv * sl * d * e
    per = {"p2p": 2 * (c - 1) * kv + (c - 1) * 2 * b * nkv * sl * d * 4,
           "a2a": 2 * ((nq + 2 * nkv) * b * sl * d * e + nq * b * sl * d * e),
           "allgather": 2 * c * kv}[comm]
    return per * layers * m


def saved_activation_bytes(cfg: MegaliteConfig, pg: ProcessGroups) -> int:
    """Bytes of distinct storages autograd saves over one micro-batch's forward, excluding the parameters'
    storages (a linear layer saves a transposed view of its weight, which is not an activation)."""
    chunks = build_model(cfg, pg, VOCAB, model_parallel_seed(1234, pg.tp_rank, pg.pp_rank, pg.cp_rank))
    seq = cfg.model.seq_length
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(0, VOCAB, (1, seq + 1), generator=gen)
    mb = {"tokens": text[:, :-1], "labels": text[:, 1:], "loss_mask": torch.ones(1, seq)}
    if pg.cp_size > 1:
        mb = context_parallel_part(mb, pg.cp_size, pg.cp_rank)
    return saved_bytes(lm_forward_step, chunks[0], mb, None, weights=chunks[0])


def groups(rank: int, cp: int) -> ProcessGroups:
    return ProcessGroups.build(RankLayout(WORLD, cp=cp), rank)


def _bytes_worker(rank: int, world: int, seq: int) -> dict:
    out = {}
    for c in (2, 4):
        for comm in COMMS:
            cfg = make_cfg(seq, c, comm, iters=2, m=2)
            pg = groups(rank, c)
            res = pretrain(cfg, pg, data=mock_data(VOCAB, seq, 1234, 64), log=QUIET)
            grad_numel = sum(b.grad_data.numel() for b in res.optimizer.buffers)
            out[(c, comm)] = dict(cp={k[1]: v // 2 for k, v in pg.comm_bytes.items() if k[0] == "cp"},
                                  dp_cp={k[1]: v // 2 for k, v in pg.comm_bytes.items() if k[0] == "dp_cp"},
                                  grad_bytes=grad_numel * 4)
    return out


def _memory_worker(rank: int, world: int, seqs: list[int]) -> dict:
    out = {}
    for c in (1, 2, 4):
        pg = ProcessGroups.single() if c == 1 else groups(rank, c)
        for s in seqs:
            if c == 1 and rank:  # serial runs on rank 0; the others wait at the next CP size's groups
                continue
            out[(c, s)] = saved_activation_bytes(make_cfg(s, c) if c > 1 else _serial_cfg(s), pg)
    return out


def _serial_cfg(seq: int) -> MegaliteConfig:
    cfg = MegaliteConfig.from_flat(dict(
        MODEL, seq_length=seq, max_position_embeddings=seq, micro_batch_size=1, global_batch_size=1,
        train_iters=1, lr=1e-4, log_interval=1, eval_iters=0, eval_interval=10_000, mock_data=True,
        vocab_size=VOCAB, seed=1234))
    validate(cfg, 1)
    return cfg


def _train_worker(rank: int, world: int, lengths: dict[int, int]) -> dict:
    out = {}
    for c, s in lengths.items():
        if c == 1:
            if rank == 0:
                res = pretrain(_serial_cfg(s), ProcessGroups.single(), data=mock_data(VOCAB, s, 1234, 8), log=QUIET)
                out[c] = res.losses[-1]
            continue
        res = pretrain(make_cfg(s, c, iters=1, m=1), groups(rank, c), data=mock_data(VOCAB, s, 1234, 8), log=QUIET)
        out[c] = res.losses[-1]
    return out


def _time_worker(rank: int, world: int, seq: int, rounds: int) -> dict:
    times: dict[str, list[float]] = {comm: [] for comm in COMMS}
    pgs = {comm: groups(rank, 4) for comm in COMMS}
    for r in range(rounds):
        order = COMMS if r % 2 == 0 else tuple(reversed(COMMS))
        for comm in order:
            cfg = make_cfg(seq, 4, comm, iters=2, m=1)
            t0 = time.perf_counter()
            pretrain(cfg, pgs[comm], data=mock_data(VOCAB, seq, 1234, 16), log=QUIET)
            times[comm].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=512, help="sequence length of the bytes and time parts")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--only", choices=["bytes", "memory", "time"], help="run one part")
    args = ap.parse_args()
    if args.only in (None, "bytes"):
        bench_bytes(args)
    if args.only in (None, "memory"):
        bench_memory()
    if args.only in (None, "time"):
        bench_time(args)


def bench_bytes(args) -> None:
    print(f"## bytes per step (seq {args.seq}, {MODEL['num_layers']} layers, 2 micro-batches per rank, fp32)")
    res = run_ranks(_bytes_worker, WORLD, args.seq, timeout=1200)
    print("| c | comm | cp bytes per step (measured) | formula | dp_cp grad bytes per step | grad buffer |")
    print("|---|---|---|---|---|---|")
    for c in (2, 4):
        for comm in COMMS:
            rows = [r[(c, comm)] for r in res]
            measured = {sum(r["cp"].values()) for r in rows}
            want = cp_formula(comm, c, args.seq, MODEL["num_layers"], 2)
            grads = {r["dp_cp"].get("grad_all_reduce", 0) for r in rows}
            ok = "exact" if measured == {want} else f"MISMATCH {sorted(measured)}"
            print(f"| {c} | {comm} | {sorted(measured)[0]:,} | {want:,} ({ok}) | {sorted(grads)[0]:,} | "
                  f"{rows[0]['grad_bytes']:,} |")



def bench_memory() -> None:
    seqs = [512 * 2 ** i for i in range(5)]  # 512 .. 8192
    print(f"\n## saved activation bytes per rank (one micro-batch, all layers + loss), cap {CAP_MB} MB")
    mem = run_ranks(_memory_worker, WORLD, seqs, timeout=1800)
    print("| seq | c=1 (MB) | c=2 (MB, / serial) | c=4 (MB, / serial) |")
    print("|---|---|---|---|")
    worst = {(c, s): max(r[(c, s)] for r in mem if (c, s) in r) for c in (1, 2, 4) for s in seqs}
    for s in seqs:
        base = worst[(1, s)]
        cells = [f"{worst[(c, s)] / 2**20:.2f} ({worst[(c, s)] / base:.3f})" for c in (2, 4)]
        print(f"| {s} | {base / 2**20:.2f} | {cells[0]} | {cells[1]} |")
    longest = {c: max([s for s in seqs if worst[(c, s)] <= CAP_MB * 2**20], default=0) for c in (1, 2, 4)}
    losses = run_ranks(_train_worker, WORLD, {c: s for c, s in longest.items() if s}, timeout=1800)
    trained = {c: next(r[c] for r in losses if c in r) for c in longest if longest[c]}
    print("\n| c | longest sequence within the cap | its loss after one training step |")
    print("|---|---|---|")
    for c in (1, 2, 4):
        loss = trained.get(c, float("nan"))
        print(f"| {c} | {longest[c]} | {loss:.4f} ({'finite' if math.isfinite(loss) else 'NOT finite'}) |")



def bench_time(args) -> None:
    print(f"\n## time of a 2-step pretrain() at c = 4, seq {args.seq} (median of {args.rounds}, slowest rank)")
    times = run_ranks(_time_worker, WORLD, args.seq, args.rounds, timeout=1800)
    med = {comm: statistics.median(max(t[comm][i] for t in times) for i in range(args.rounds)) for comm in COMMS}
    print("| comm | median (s) | / p2p |")
    print("|---|---|---|")
    for comm in COMMS:
        print(f"| {comm} | {med[comm]:.3f} | {med[comm] / med['p2p']:.3f} |")


if __name__ == "__main__":
    main()
