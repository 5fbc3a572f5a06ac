"""--optimizer-cpu-offload: bytes per parameter the optimizer holds in its host pool and on the device,
measured after a step (MegaliteOptimizer.memory_bytes) against the formula, and the step time against
the run without offload in the same process (a ratio; on a GPU also the device's allocated memory).

    OMP_NUM_THREADS=1 python bench/bench_offload.py          # table for bench/README.md
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite import device  # noqa: E402
from megalite.config import validate  # noqa: E402
from megalite.config.arguments import MegaliteConfig  # noqa: E402
from megalite.training.loop import pretrain  # noqa: E402
from tests.tp_utils import mock_data  # noqa: E402

VOCAB, SEQ, ITERS = 4000, 128, 6
MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=SEQ, max_position_embeddings=SEQ)


def formula(bf16: bool, fraction_on_host: float) -> tuple[float, float]:
    """(host, device) optimizer bytes per parameter: the host pool keeps main + grad staging + two moments
    (16); the device keeps two moments (8) plus an fp32 main copy when the weights are not fp32 (4)."""
    return 16 * fraction_on_host, (12 if bf16 else 8) * (1 - fraction_on_host)


def run(bf16: bool, offload: bool, fraction: float) -> dict:
    cfg = MegaliteConfig.from_flat(dict(
        MODEL, micro_batch_size=4, global_batch_size=4, train_iters=ITERS, lr=1e-3, log_interval=1000,
        eval_iters=0, eval_interval=10000, mock_data=True, vocab_size=VOCAB, bf16=bf16,
        optimizer_cpu_offload=offload, optimizer_offload_fraction=fraction))
    validate(cfg, 1)
    times: list[float] = []
    last = [time.perf_counter()]

    def log(_line: str) -> None:
        device.synchronize()
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    cfg.training.log_interval = 1
    res = pretrain(cfg, _single(), data=mock_data(VOCAB, SEQ, 1234, ITERS * 4), log=log)
    mem = res.optimizer.memory_bytes()
    return {"mem": mem, "step_s": statistics.median(times[2:]) if len(times) > 3 else min(times),
            "device_mb": device.memory_stats().get("allocated_mb")}


def _single():
    from megalite.parallel.groups import ProcessGroups

    return ProcessGroups.single()


def main() -> None:
    print(f"device: {device.device_name()}, pinned host pool: {device.pin_memory_supported()}")
    print("| precision | offload fraction | host pool B/param (formula) | device B/param (formula) "
          "| step time vs no offload | device allocated MB |")
    print("|---|---|---|---|---|---|")
    for bf16 in (False, True):
        base = run(bf16, False, 1.0)
        for offload, fraction in ((False, 1.0), (True, 0.5), (True, 1.0)):
            r = base if not offload else run(bf16, True, fraction)
            m = r["mem"]
            n = m["elements"]
            host, dev = m["host_pool"] / n, m["device"] / n
            f_host, f_dev = formula(bf16, m["host_elements"] / n)
            mb = "-" if r["device_mb"] is None else f"{r['device_mb']:.1f}"
            print(f"| {'bf16' if bf16 else 'fp32'} | {fraction if offload else 0} | {host:.2f} ({f_host:.2f}) | "
                  f"{dev:.2f} ({f_dev:.2f}) | {r['step_s'] / base['step_s']:.2f}x | {mb} |")


if __name__ == "__main__":
    main()
