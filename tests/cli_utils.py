"""Run pretrain_gpt.py as users do (python or torchrun) and read the losses from its log lines."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


def losses(proc: subprocess.CompletedProcess) -> dict[int, tuple[float, float]]:
    """{iteration: (lm loss, grad norm or None on a skipped step)} from the log lines; fails loudly if
    the run failed."""
    assert proc.returncode == 0, f"run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    found = {int(m[1]): (float(m[2]), float(m[3]) if m[3] else None) for m in LOSS.finditer(proc.stdout)}
    assert found, f"no log lines in:\n{proc.stdout[-2000:]}"
    return found


def load_tool(name: str):
    """Import tools/NAME.py (the tools are scripts, not a package) as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
