"""Promise: pretrain_gpt.py compares the planner's bytes per rank with the memory the ranks have before
anything is allocated (megalite/planning/memory_check.py, device.memory_capacity): past it the run is
refused naming the estimate, its largest terms and the flags behind them, unless --skip-memory-check; on
CPU the host's available memory is shared by the ranks on the host; where the planner or the host cannot
say, a warning instead of a refusal; the README's and the tests' small models pass. (The refusal through
the entry point itself: tests/test_bad_inputs_entry_points.py, pretrain-*-past-memory.)"""

from __future__ import annotations

import pytest

from megalite import device
from megalite.config import parse_args, validate
from megalite.device import MemoryCapacity
from megalite.planning import memory_check
from megalite.planning.memory_check import MemoryCheckError, check_memory

GB = 10**9
SMALL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
         "--global-batch-size 4 --train-iters 8")
README = f"--mock-data --vocab-size 1000 {SMALL}"
QUICKSTART = ("--tokenizer-type GPT2BPETokenizer --vocab-file v.json --merge-file m.txt --data-path d --num-layers 4 "
              "--hidden-size 256 --num-attention-heads 4 --seq-length 128 --micro-batch-size 8 --global-batch-size 16")
TESTS_TINY = ("--mock-data --vocab-size 128 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
              "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 2")


def cfg_of(flags: str, world: int = 1):
    cfg = parse_args(flags.split())
    validate(cfg, world, world)
    return cfg


def refusal(flags: str, capacity: MemoryCapacity, world: int = 1) -> str:
    with pytest.raises(MemoryCheckError) as e:
        check_memory(cfg_of(flags, world), world, capacity)
    return str(e.value)


def test_a_vocabulary_of_millions_is_refused_naming_estimate_terms_and_flags():
    msg = refusal(f"--mock-data {SMALL} --vocab-size 50000000", MemoryCapacity(16 * GB, 1, "the test's memory"))
    assert "\n" not in msg
    assert "memory check: the planner estimates 64.00 GB per rank" in msg and "the test's memory: 16.00 GB" in msg
    assert "optimizer state 25.60 GB (3.20 B parameters, mostly --vocab-size 50000000 x --hidden-size 64)" in msg
    assert "--seq-length 32 x --micro-batch-size 2 x --vocab-size 50000000 (fp32 logits)" in msg
    assert "--skip-memory-check" in msg


def test_a_sequence_of_millions_is_refused_naming_seq_length():
    flags = f"--mock-data --vocab-size 1000 {SMALL} --seq-length 4000000 --max-position-embeddings 4000000"
    msg = refusal(flags, MemoryCapacity(16 * GB, 1, "x"))
    assert "Largest terms: activations" in msg and "--seq-length 4000000 x --micro-batch-size 2" in msg
    assert "--max-position-embeddings 4000000 x --hidden-size 64" in msg  # the learned positions' rows
    unfused = refusal(f"{flags} --attention-backend unfused", MemoryCapacity(16 * GB, 1, "x"))
    assert "x --seq-length 4000000 x --num-attention-heads 4 (--attention-backend unfused keeps the scores)" in unfused


def test_the_ranks_on_a_host_share_its_memory():
    flags = f"--mock-data {SMALL} --vocab-size 2000000 --global-batch-size 8"  # about 2.7 GB per rank
    cfg = cfg_of(flags)
    assert check_memory(cfg, 1, MemoryCapacity(8 * GB, 1, "host")) is None
    msg = refusal(flags, MemoryCapacity(8 * GB, 4, "host"), world=4)
    assert "host: 8.00 GB shared by 4 ranks = 2.00 GB each" in msg


def test_skip_memory_check_starts_anyway():
    cfg = cfg_of(f"--mock-data {SMALL} --vocab-size 50000000 --skip-memory-check")
    assert check_memory(cfg, 1, MemoryCapacity(1 * GB, 1, "x")) is None


def test_what_cannot_be_estimated_is_a_warning_not_a_refusal(monkeypatch):
    cfg = cfg_of(README)
    assert "does not report its available memory" in check_memory(cfg, 1, None)

    def fails(_):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(memory_check, "peak_memory", fails)
    warning = check_memory(cfg, 1, MemoryCapacity(1, 1, "x"))
    assert "the planner cannot estimate this configuration (ZeroDivisionError" in warning


@pytest.mark.parametrize("flags", [README, QUICKSTART, TESTS_TINY])
def test_small_models_pass_well_below_a_laptop(flags):
    cfg = cfg_of(flags)
    assert check_memory(cfg, 1, MemoryCapacity(8 * GB, 8, "a small host")) is None  # 1 GB per rank
    assert check_memory(cfg, 1, device.memory_capacity(0, 1)) is None  # this host, as pretrain_gpt.py asks


def test_host_memory_comes_from_memavailable(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  4000 kB\nMemFree:  1000 kB\nMemAvailable:   2048 kB\n")
    assert device._mem_available(str(meminfo)) == 2048 * 1024
    meminfo.write_text("MemTotal:  4000 kB\n")
    assert device._mem_available(str(meminfo)) is None
    assert device._mem_available(str(tmp_path / "missing")) is None
