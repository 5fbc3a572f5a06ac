"""Checkpoint I/O against the disk it lands on, and offline conversion times.

All in one run, on the same filesystem (``--dir``):

1. save: ``save_checkpoint`` of a GPT-2 style model with its optimizer state (fp32 weights, fp32 main
   params + Adam moments) from every rank in parallel (TP=2 on 2 ranks by default), barrier to commit,
   against one process writing the same number of bytes sequentially to one file (64 MiB writes, then
   fsync), which is the disk's plain streaming rate. Both include the fsync that makes them durable.
2. load: ``load_checkpoint`` of that checkpoint into the same layout (weights and optimizer state),
   against one process reading the plain file back. "cold" evicts the files from this machine's page
   cache first (posix_fadvise DONTNEED on clean, fsynced pages); "warm" reads them from the cache.
3. checksums: steps 1 and 2 are also run with the per-file CRC-32 turned off (saved as null, so not
   checked on load), and the time with it is printed as a ratio of the time without it.
4. conversion: ``convert_checkpoint.py reshard`` (TP=2 PP=1 -> TP=1 PP=2, optimizer included) and
   ``to-hf`` (-> GPT2LMHeadModel safetensors), single process, wall time and GB/s of the bytes written.

Each figure is the median of ``--repeats`` runs. GB/s = 1e9 bytes / s.

    OMP_NUM_THREADS=1 python bench/bench_checkpoint.py                        # ~0.7 GB checkpoint
    OMP_NUM_THREADS=1 python bench/bench_checkpoint.py --hidden-size 768 --num-layers 12 --dir /data/tmp
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

from megalite.checkpointing import destination, load_checkpoint, save_checkpoint  # noqa: E402
from megalite.checkpointing.metadata import config_dict  # noqa: E402
from megalite.checkpointing.paths import iter_dirname  # noqa: E402
from megalite.config import validate  # noqa: E402
from megalite.config.arguments import MegaliteConfig  # noqa: E402
from megalite.model.build import build_model  # noqa: E402
from megalite.optimizer.optimizer import MegaliteOptimizer  # noqa: E402
from megalite.tensor_parallel.random import model_parallel_seed  # noqa: E402
from megalite.training.resume import rng_states  # noqa: E402
from megalite.training.train_step import build_buffers  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.tp_utils import groups_for  # noqa: E402

CHUNK = 64 << 20


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def evict(path: str) -> None:
    """Drop a file's (or a folder's files') clean pages from the page cache."""
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_write(path: str, nbytes: int) -> float:
    buf = os.urandom(CHUNK)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(memoryview(buf)[: min(left, CHUNK)])
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def plain_read(path: str) -> float:
    buf = bytearray(CHUNK)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def make_cfg(a: dict) -> MegaliteConfig:
    return MegaliteConfig.from_flat(dict(
        num_layers=a["num_layers"], hidden_size=a["hidden_size"], num_attention_heads=a["hidden_size"] // 64,
        seq_length=128, tensor_model_parallel_size=a["tp"], micro_batch_size=1, global_batch_size=a["world"],
        train_iters=1, mock_data=True, vocab_size=a["vocab"], hidden_dropout=0.0, attention_dropout=0.0))


def _checksums(on: bool) -> None:
    """Turn the per-file CRC-32 of saves (and so its check on load) on or off in this process."""
    from megalite.checkpointing import checksum, metadata

    metadata.file_checksum = checksum.file_checksum if on else (lambda path: None)


def _save_load(rank: int, pg, chunks, optimizer, tracker, config: dict, ckpt: str, repeats: int, out: dict,
               tag: str = "") -> None:
    """Median-able save, cold load and warm load times into out[save+tag], out[load_cold+tag], ..."""
    for _ in range(repeats):
        if rank == 0:  # only what the last save wrote: the folder and its lock stay (main holds them)
            shutil.rmtree(os.path.join(ckpt, iter_dirname(1)), ignore_errors=True)
        dist.barrier()
        t0 = time.perf_counter()
        save_checkpoint(ckpt, 1, chunks, optimizer, pg, config, {"iteration": 1}, rng_states(tracker))
        out.setdefault("save" + tag, []).append(time.perf_counter() - t0)  # save_checkpoint ends in a collective
    for kind in ("load_cold", "load_warm"):
        for _ in range(repeats):
            if rank == 0 and kind == "load_cold":
                evict(ckpt)
            dist.barrier()
            t0 = time.perf_counter()
            load_checkpoint(ckpt, chunks, optimizer, pg, config)
            dist.barrier()
            out.setdefault(kind + tag, []).append(time.perf_counter() - t0)


def _ranks(rank: int, world: int, a: dict, root: str) -> dict:
    cfg = make_cfg(a)
    validate(cfg, world)
    pg = groups_for(world, rank, tp=a["tp"])
    tracker = model_parallel_seed(1234, pg.tp_rank, pg.pp_rank)
    chunks = build_model(cfg, pg, a["vocab"], tracker)
    optimizer = MegaliteOptimizer(build_buffers(chunks, cfg, pg), cfg, pg)
    config = config_dict(cfg.model, a["vocab"])
    out: dict = {k: [] for k in ("write", "read_cold", "read_warm")}
    ckpt = os.path.join(root, "ckpt")
    _checksums(False)  # the same saves and loads without the checksum, for the ratio
    _save_load(rank, pg, chunks, optimizer, tracker, config, ckpt, a["repeats"], out, "_nocrc")
    _checksums(True)
    _save_load(rank, pg, chunks, optimizer, tracker, config, ckpt, a["repeats"], out)
    out["bytes"] = dir_bytes(ckpt)
    if rank == 0:  # the disk's plain sequential rate, same bytes, same filesystem
        plain = os.path.join(root, "plain.bin")
        for _ in range(a["repeats"]):
            out["write"].append(plain_write(plain, out["bytes"]))
            evict(plain)
            out["read_cold"].append(plain_read(plain))
            out["read_warm"].append(plain_read(plain))
            os.remove(plain)
    dist.barrier()
    return out


def convert_times(root: str, repeats: int) -> dict:
    from transformers import GPT2LMHeadModel  # noqa: F401 - import once, outside the timings

    from tools.convert_checkpoint import main as convert

    ckpt = os.path.join(root, "ckpt")
    out: dict = {"reshard": [], "to_hf": []}
    for _ in range(repeats):
        dst = os.path.join(root, "resharded")
        shutil.rmtree(dst, ignore_errors=True)
        t0 = time.perf_counter()
        assert convert(["reshard", "--load", ckpt, "--save", dst, "--tensor-model-parallel-size", "1",
                        "--pipeline-model-parallel-size", "2"]) == 0
        out["reshard"].append(time.perf_counter() - t0)
        out["reshard_bytes"] = dir_bytes(dst)
        hf = os.path.join(root, "hf")
        shutil.rmtree(hf, ignore_errors=True)
        t0 = time.perf_counter()
        assert convert(["to-hf", "--load", ckpt, "--save", hf]) == 0
        out["to_hf"].append(time.perf_counter() - t0)
        out["to_hf_bytes"] = dir_bytes(hf)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder under /tmp)")
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args()
    a = {"hidden_size": args.hidden_size, "num_layers": args.num_layers, "vocab": args.vocab, "tp": args.tp,
         "world": args.world, "repeats": args.repeats}
    root = tempfile.mkdtemp(prefix="megalite-bench-ckpt-", dir=args.dir)
    try:
        # the rule of every checkpoint writer (checkpointing/destination.py): the folder's lock, held while
        # the ranks save into it (in place: each save replaces only its own iteration folder)
        with destination.claim(os.path.join(root, "ckpt"), (), print, flag="--dir", in_place=True):
            ranks = run_ranks(_ranks, args.world, a, root, timeout=1800)
        conv = convert_times(root, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    nbytes = ranks[0]["bytes"]
    slowest = lambda k: med([max(r[k][i] for r in ranks) for i in range(args.repeats)])  # noqa: E731
    rows = [("save_checkpoint", slowest("save"), nbytes), ("plain sequential write", med(ranks[0]["write"]), nbytes),
            ("load_checkpoint, cold cache", slowest("load_cold"), nbytes),
            ("plain sequential read, cold", med(ranks[0]["read_cold"]), nbytes),
            ("load_checkpoint, warm cache", slowest("load_warm"), nbytes),
            ("plain sequential read, warm", med(ranks[0]["read_warm"]), nbytes),
            ("reshard TP2 -> TP1 PP2 (written)", med(conv["reshard"]), conv["reshard_bytes"]),
            ("to-hf (written)", med(conv["to_hf"]), conv["to_hf_bytes"])]
    print(f"checkpoint: GPT-2 style h={args.hidden_size} L={args.num_layers} vocab={args.vocab}, "
          f"TP={args.tp} on {args.world} ranks, {nbytes / 1e9:.3f} GB (weights + optimizer), under {root}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'':36s} {'seconds':>8s} {'GB/s':>7s}")
    for name, sec, b in rows:
        print(f"{name:36s} {sec:8.3f} {b / sec / 1e9:7.2f}")
    print(f"save / plain write: {(nbytes / slowest('save')) / (nbytes / med(ranks[0]['write'])):.2f}x   "
          f"cold load / plain read: {med(ranks[0]['read_cold']) / slowest('load_cold'):.2f}x")
    print("time with the per-file CRC-32 / time without it: "
          + "   ".join(f"{k} {slowest(k) / slowest(k + '_nocrc'):.2f}x" for k in ("save", "load_cold", "load_warm"))
          + f"   (without: save {slowest('save_nocrc'):.3f} s, cold load {slowest('load_cold_nocrc'):.3f} s, "
          f"warm load {slowest('load_warm_nocrc'):.3f} s)")
    if args.json:
        json.dump({"args": a, "rows": [{"name": n, "seconds": s, "bytes": b} for n, s, b in rows]},
                  open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
