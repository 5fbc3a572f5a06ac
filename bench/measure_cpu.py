"""This machine's figures for the planner's `cpu` preset (megalite/planning/hardware.py): the best matmul
TFLOP/s in fp32 and bf16 over a few large shapes, the memory bandwidth of a large copy (bytes read +
written), gloo's all-reduce bus bandwidth between 2 local processes, and the memory the host has; and the
figures for the eager kernels of a CPU step (planning/eager.py, bench/README.md): an elementwise GeLU's
bandwidth, the cost of one autograd operator call, dropout's random-mask throughput (bernoulli_) and the
cost of touching freshly allocated memory (page faults, not modelled: its bytes depend on the allocator).

    OMP_NUM_THREADS=1 python bench/measure_cpu.py    # the threads bench_planner_cpu.py's ranks run with

Prints one line per figure and warns when the load average exceeds the cores (the figures are then low).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = (1024, 2048, 3072)
REPEATS = 5


def best_of(fn, repeats: int = REPEATS) -> float:
    """The fastest of ``repeats`` timed calls (after one warm-up), in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_tflops(dtype: torch.dtype, shapes: tuple[int, ...] = SHAPES) -> float:
    """The best TFLOP/s of a square matmul over ``shapes``."""
    out = 0.0
    for n in shapes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        out = max(out, 2 * n**3 / best_of(lambda a=a, b=b: torch.mm(a, b)) / 1e12)
    return out


def copy_gbps(nbytes: int = 512 * 2**20) -> float:
    """GB/s of a large copy, read + written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    return 2 * nbytes / best_of(lambda: dst.copy_(src)) / 1e9


def gelu_gbps(n: int = 8_000_000) -> float:
    """GB/s of an elementwise GeLU over a large fp32 tensor (read + written): the non-GEMM work's pace,
    against the copy's."""
    x = torch.rand(n)
    return 8 * n / best_of(lambda: torch.nn.functional.gelu(x)) / 1e9


def autograd_op_us(n: int = 500) -> float:
    """Microseconds per elementwise operator on a tiny tensor, forward and its backward under autograd: the
    cost of a call whatever its bytes (the profile's "other" operators, bench/README.md)."""
    x0 = torch.ones(8, requires_grad=True)

    def chain() -> None:
        x = x0
        for _ in range(n):
            x = x * 1.0001
        x.sum().backward()
    return best_of(chain) / n * 1e6


def bernoulli_gelems(n: int = 4_000_000) -> float:
    """Billions of elements per second of an in-place fp32 bernoulli_ (dropout's keep mask): on a CPU a
    random-number generator's pace, not a memory bandwidth."""
    x = torch.empty(n)
    return n / best_of(lambda: x.bernoulli_(0.9)) / 1e9


def first_touch_us(nbytes: int = 64 * 2**20) -> float:
    """Microseconds per 4 KiB page of writing freshly mapped memory, beyond writing memory already mapped
    (a fill of a new 64 MiB tensor, which the allocator maps afresh, against one of a reused tensor)."""
    n, reused = nbytes // 4, torch.empty(nbytes // 4)
    fresh = best_of(lambda: torch.empty(n).fill_(1.0))
    return (fresh - best_of(lambda: reused.fill_(1.0))) / (nbytes / 4096) * 1e6


def _allreduce_worker(rank: int, world: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = torch.ones(16 * 2**20)  # 64 MiB
    t = best_of(lambda: dist.all_reduce(x))
    if rank == 0:
        out.put(2 * (world - 1) / world * x.numel() * 4 / t / 1e9)  # bus bandwidth
    dist.destroy_process_group()


def gloo_gbps(world: int = 2) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_allreduce_worker, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    value = q.get(timeout=300)
    for p in procs:
        p.join()
    return value


def main() -> int:
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores:
        print(f"warning: load average {load:.1f} > {cores} cores: the figures below are low")
    print(f"cores {cores}, torch threads {torch.get_num_threads()}, torch {torch.__version__}")
    print(f"matmul fp32 {matmul_tflops(torch.float32):.4f} TFLOP/s")
    print(f"matmul bf16 {matmul_tflops(torch.bfloat16, (512,)):.4f} TFLOP/s")
    print(f"copy {copy_gbps():.2f} GB/s (read + written)")
    print(f"GeLU {gelu_gbps():.2f} GB/s (read + written)")
    print(f"an autograd operator on a tiny tensor, forward + backward {autograd_op_us():.2f} us")
    print(f"bernoulli_ (dropout masks) {bernoulli_gelems():.4f} G elements/s")
    print(f"first touch of fresh memory {first_touch_us():.2f} us per 4 KiB page")
    print(f"gloo all-reduce bus bandwidth, 2 processes {gloo_gbps():.3f} GB/s")
    print(f"host memory {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 1e9:.1f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
