"""Promise: tools/plot_logs.py reads what a real run writes (the stdout log lines, and the TensorBoard
events of --tensorboard-dir) and draws loss, LR, grad norm, loss scale and throughput into a PNG; the
values it parses are the logged ones, skipped (fp16 overflow) steps and restarts are recognised."""

from __future__ import annotations

import subprocess
import sys

import matplotlib.image
import pytest

from tests.cli_utils import LOSS, ROOT, run_pretrain

sys.path.insert(0, str(ROOT / "tools"))
import plot_logs  # noqa: E402

ITERS = 10
# fp16 with a loss scale far too high: the first steps overflow and are skipped, the scale halves.
ARGS = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(ITERS), "--lr", "1e-3",
        "--lr-warmup-iters", "3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
        "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "1", "--num-layers", "2",
        "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings",
        "32", "--fp16", "--initial-loss-scale", "1048576", "--hysteresis", "1", "--loss-scale-window", "3"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple:
    d = tmp_path_factory.mktemp("plot")
    proc = run_pretrain(ARGS + ["--tensorboard-dir", str(d / "tb")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = d / "run.log"
    log.write_text(proc.stdout)
    return d, log, proc.stdout


def test_parsed_values_are_the_logged_ones(run):
    _, log, stdout = run
    parsed = plot_logs.parse_log(log.read_text().splitlines(), "run")
    logged = {int(m[1]): float(m[2]) for m in LOSS.finditer(stdout)}
    assert parsed.train["lm loss"] == logged and sorted(logged) == list(range(1, ITERS + 1))
    assert sorted(parsed.valid) == [4, 8, 10]
    scales = [parsed.train["loss scale"][i] for i in range(1, ITERS + 1)]
    assert scales[0] == 1048576.0 and min(scales) < scales[0]  # overflow backoff shows on the curve
    skipped = plot_logs._skipped(parsed)
    assert skipped and skipped[0] == 1
    assert all(i not in parsed.train["grad norm"] for i in skipped)  # no grad norm on a skipped step
    assert set(parsed.train["learning rate"]) == set(logged) and parsed.train["tokens per second"]
    assert parsed.restarts == 0


def test_writes_png_and_csv_from_log(run, capsys):
    d, log, _ = run
    png, table = d / "run.png", d / "run.csv"
    assert plot_logs.main([str(log), "--output", str(png), "--csv", str(table), "--title", "fp16 run"]) == 0
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 600 and image.shape[1] > 1000  # a grid of panels, not an empty canvas
    assert image[..., :3].std() > 0.05
    out = capsys.readouterr().out
    for panel in ("lm loss", "learning rate", "grad norm", "loss scale", "throughput (tokens/s)"):
        assert panel in out
    rows = table.read_text().splitlines()
    assert len(rows) == 1 + ITERS and "lm loss" in rows[0]


def test_reads_tensorboard_events_of_the_same_run(run):
    d, log, stdout = run
    tb = plot_logs.read_tensorboard(str(d / "tb"))
    from_log = plot_logs.parse_log(stdout.splitlines())
    for key in ("lm loss", "learning rate", "loss scale"):
        assert sorted(tb.train[key]) == sorted(from_log.train[key])
        for it, v in from_log.train[key].items():
            assert abs(tb.train[key][it] - v) <= 1e-6 * max(abs(v), 1e-3), (key, it)
    assert sorted(tb.valid) == sorted(from_log.valid)
    png = d / "tb.png"
    assert plot_logs.main(["--tensorboard-dir", str(d / "tb"), "--output", str(png)]) == 0
    assert png.stat().st_size > 20_000


def test_restarted_run_keeps_the_later_values_and_counts_restarts(run):
    _, log, _ = run
    lines = log.read_text().splitlines()
    first = [ln for ln in lines if "iteration " in ln]
    resumed = [ln.replace("lm loss: ", "lm loss: 9") for ln in first[5:]]  # a restart after iteration 5
    parsed = plot_logs.parse_log(["[default3]:" + ln for ln in first + resumed], "r")  # torchrun prefixes
    assert parsed.restarts == 1 and len(parsed.train["lm loss"]) == ITERS
    assert parsed.train["lm loss"][ITERS] > 9


def test_cli_errors():
    tool = [sys.executable, str(ROOT / "tools" / "plot_logs.py")]
    out = subprocess.run(tool + ["--output", "x.png"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "at least one log file" in out.stderr
    out = subprocess.run(tool + ["/nonexistent.log", "--output", "x.png"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "no such file" in out.stderr
