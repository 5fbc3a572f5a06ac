"""Run pretrain_gpt.py as users do (python or torchrun) and read the losses from its log lines; hold a
parallel run's log to the single-process run's (trained once per session for each command); check that a
refused command failed by name and left the files it was given as they were."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from tests.asserts import assert_rel_close

ROOT = Path(__file__).resolve().parents[1]
TRACEBACK = "Traceback (most recent call last)"
TORCHRUN_ENV = "MEGALITE_TESTS_TORCHRUN"
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|(?:.*?grad norm: ([0-9.]+))?")


def run_pretrain(args: list[str], nproc: int = 1, timeout: float = 300, env: dict | None = None
                 ) -> subprocess.CompletedProcess:
    if nproc == 1:
        cmd = [sys.executable, str(ROOT / "pretrain_gpt.py"), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(ROOT / "pretrain_gpt.py"), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=full_env)


def _pretrain_rank(rank: int, world: int, args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """pretrain_gpt.main on one harness rank: (exit code, stdout, stderr)."""
    os.environ.update(env)
    spec = importlib.util.spec_from_file_location("pretrain_gpt", ROOT / "pretrain_gpt.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = entry.main(list(args))
        except SystemExit as e:  # a flag error: argparse exits
            code = e.code if isinstance(e.code, int) else 1
    return code or 0, out.getvalue(), err.getvalue()


def launch_pretrain(args: list[str], nproc: int = 1, timeout: float = 300, env: dict | None = None
                    ) -> subprocess.CompletedProcess:
    """pretrain_gpt.py's ``main`` on ``nproc`` ranks of the test harness: the whole entry point (flags,
    validation, the ranks' process group, training, the log lines, every rank's output in rank order)
    without starting an interpreter and torchrun per run, for the many layout comparisons. torchrun
    itself: ``run_pretrain`` (each file comparing layouts keeps one case through it; with
    MEGALITE_TESTS_TORCHRUN=1 every call goes through it, as scripts/test_torch.sh --subset runs them)."""
    from tests.harness import run_ranks

    if os.environ.get(TORCHRUN_ENV) == "1":  # scripts/test_torch.sh --subset: every case through torchrun
        return run_pretrain(args, nproc, timeout, env)
    env = {"OMP_NUM_THREADS": "1", "MEGALITE_NCCL_SEMANTICS": os.environ.get("MEGALITE_NCCL_SEMANTICS", "0"),
           **(env or {})}
    ranks = run_ranks(_pretrain_rank, nproc, list(args), env, timeout=timeout)
    code = next((c for c, _, _ in ranks if c), 0)
    return subprocess.CompletedProcess(args, code, "".join(o for _, o, _ in ranks), "".join(e for _, _, e in ranks))


def losses(proc: subprocess.CompletedProcess) -> dict[int, tuple[float, float]]:
    """{iteration: (lm loss, grad norm or None on a skipped step)} from the log lines; fails loudly if
    the run failed."""
    assert proc.returncode == 0, f"run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    found = {int(m[1]): (float(m[2]), float(m[3]) if m[3] else None) for m in LOSS.finditer(proc.stdout)}
    assert found, f"no log lines in:\n{proc.stdout[-2000:]}"
    return found


MOE_LOG = re.compile(r"iteration\s+(\d+)/.*?\| lm loss: ([0-9.E+-]+) \|.*?\| load balancing loss: ([0-9.E+-]+) \|"
                     r"(?: z loss: ([0-9.E+-]+) \|)?(?:.*?grad norm: ([0-9.]+))?")


def moe_losses(proc: subprocess.CompletedProcess) -> dict[int, dict[str, float | None]]:
    """{iteration: {"lm", "lb" (load balancing loss), "z" (z loss or None), "grad_norm" (None on a skipped
    step)}} from an MoE run's log lines; fails loudly if the run failed."""
    assert proc.returncode == 0, f"run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    found = {int(m[1]): {"lm": float(m[2]), "lb": float(m[3]), "z": float(m[4]) if m[4] else None,
                         "grad_norm": float(m[5]) if m[5] else None} for m in MOE_LOG.finditer(proc.stdout)}
    assert found, f"no MoE log lines in:\n{proc.stdout[-2000:]}"
    return found


Log = dict[int, tuple[float, float | None]] | dict[int, dict[str, float | None]]
_SERIAL: dict[tuple, Log] = {}


def serial_losses(args: list[str], parse: Callable[[subprocess.CompletedProcess], Log] = losses) -> Log:
    """The log (``losses`` or ``moe_losses``) of the single-process run of ``args``, run once per session
    however many layouts compare against it; it must hold every iteration 1..--train-iters."""
    key = (tuple(args), parse.__name__)
    if key not in _SERIAL:
        log = parse(launch_pretrain(args))
        iters = int(args[max(i for i, a in enumerate(args) if a == "--train-iters") + 1])  # the last one counts
        assert sorted(log) == list(range(1, iters + 1)), f"serial run logged iterations {sorted(log)}"
        _SERIAL[key] = log
    return _SERIAL[key]


def _fields(entry: tuple | dict) -> dict[str, float | None]:
    return entry if isinstance(entry, dict) else {"lm loss": entry[0], "grad norm": entry[1]}


def assert_same_log_curves(parallel: Log, serial: Log, iters: Iterable[int], what: str, rtol: float = 1e-5) -> None:
    """``parallel`` logged exactly the iterations ``iters``, and each of its fields (lm loss and grad norm;
    an MoE log's load-balancing and z loss too) equals ``serial``'s there within ``rtol``."""
    its = list(iters)
    assert sorted(parallel) == its, f"{what}: logged iterations {sorted(parallel)}, not {its}"
    missing = [i for i in its if i not in serial]
    assert not missing, f"{what}: the serial run did not log iterations {missing}"
    for name in _fields(serial[its[0]]):
        assert_rel_close([_fields(parallel[i])[name] for i in its], [_fields(serial[i])[name] for i in its], rtol,
                         f"{what} {name}")


def load_tool(name: str):
    """Import tools/NAME.py (the tools are scripts, not a package) as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tree_hash(path: str) -> str:
    """One digest of every file's relative path and bytes under ``path``."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                h.update(os.path.relpath(full, path).encode() + b"\0" + f.read())
    return h.hexdigest()


def refused(proc: subprocess.CompletedProcess, *named: str) -> str:
    """stdout + stderr of a command that failed (non-zero exit) without a Python traceback, naming every
    text in ``named``."""
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert TRACEBACK not in out, out[-3000:]
    for n in named:
        assert n in out, f"{n!r} not in:\n{out[-3000:]}"
    return out


def continue_flags(load: str, train_iters: int) -> list[str]:
    """pretrain_gpt.py flags that continue the Megatron-LM run saved in ``load`` on mock data (its model flags
    as convert_checkpoint prints them; global batch 8, lr 1e-3, weight decay 0.1, dropout off)."""
    from megalite.checkpointing.megatron.read import read_megatron
    from tools.convert_checkpoint import model_flags

    return ["--mock-data", "--vocab-size", "95", *model_flags(read_megatron(load).config).split(), "--seq-length",
            "16", "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1", "--train-iters",
            str(train_iters), "--lr", "1e-3", "--weight-decay", "0.1", "--hidden-dropout", "0", "--attention-dropout",
            "0"]
