"""Every tool entry point (each tools/*.py with a main, soak.py aside, and tasks/main.py) says an interrupt or
the system's refusal of its write (a full disk, a file-size limit, a permission) in one line, exits 130 for
Ctrl-C and non-zero for the others, and leaves no partial output behind.

Each tool gets a case: a cheap valid command line, and the place its output is written, where the failure is
injected (after a partial write, so leaving it behind would be seen). A tool with no case fails the
enumeration test, so a new tool cannot skip the rule."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIPPED = {"soak.py"}  # its own rules (soak runs are tested on their own)


def entry_points() -> list[str]:
    """tools/NAME.py files that are programs (define main), and tasks/main.py."""
    tools = [f"tools/{p.name}" for p in sorted((ROOT / "tools").glob("*.py"))
             if p.name not in SKIPPED and "\ndef main(" in p.read_text()]
    return [*tools, "tasks/main.py"]


def load(entry: str, monkeypatch: pytest.MonkeyPatch):
    """The entry point's module, registered while the test runs (a dataclass in it needs its module)."""
    name = "entry_" + Path(entry).stem if entry != "tasks/main.py" else "entry_tasks_main"
    spec = importlib.util.spec_from_file_location(name, ROOT / entry)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)
    spec.loader.exec_module(mod)
    return mod


# ---- fixtures the cases write from --------------------------------------------------------------------------


def _dataset(prefix: str, docs: int = 4) -> None:
    from megalite.data.indexed_dataset import IndexedDatasetWriter

    with IndexedDatasetWriter(prefix, np.int32) as w:
        for i in range(docs):
            w.add_document(np.arange(1, 300 + i, dtype=np.int32))
        w.finalize()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    """A tiny checkpoint (NullTokenizer ids) for generate.py, tasks/main.py and convert_checkpoint.py."""
    from tests.test_generation import write_test_checkpoint
    from tests.tp_utils import GPT2

    return write_test_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "c"), {**GPT2, "num_layers": 1}, 1, 1,
                                 vocab=64)


@dataclass
class Case:
    argv: Callable[[Path, str], list[str]]  # (work folder, checkpoint) -> command line
    inject: Callable[[pytest.MonkeyPatch, object, BaseException], None]  # raise at the tool's write
    outputs: Callable[[Path], list[Path]]  # what must not exist after a failure


def _partial_then(exc: BaseException, path_of: Callable[..., str]):
    """A stand-in writer: a few bytes at the output's (temporary) path, then ``exc``."""
    def fake(*args, **kwargs):
        with open(path_of(*args, **kwargs), "w") as f:
            f.write("partial")
        raise exc
    return fake


def _raise(exc: BaseException):
    def fake(*args, **kwargs):
        raise exc
    return fake


def _savefig(mp, mod, exc):
    from matplotlib.figure import Figure

    mp.setattr(Figure, "savefig", _partial_then(exc, lambda self, path, **kw: path))


def _json_dump(mp, mod, exc):
    def fake(obj, f, **kw):
        f.write("[partial")
        f.flush()
        raise exc
    mp.setattr(json, "dump", fake)


def _writer_add(name: str):
    def inject(mp, mod, exc):
        from megalite.data import indexed_dataset

        real = getattr(indexed_dataset.IndexedDatasetWriter, name)

        def fake(self, *a, **kw):
            real(self, *a, **kw)
            self._bin.flush()
            raise exc
        mp.setattr(indexed_dataset.IndexedDatasetWriter, name, fake)
    return inject


def _tokenizer_training(mp, mod, exc):
    from megalite.data import tokenizer_training

    fake = _partial_then(exc, lambda texts, vocab, out, *a, **kw: os.path.join(out, "vocab.json"))
    mp.setattr(tokenizer_training, "train_bpe", fake)
    if hasattr(mod, "train_bpe"):
        mp.setattr(mod, "train_bpe", fake)


def _jsonl(tmp: Path) -> str:
    path = tmp / "in.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(str(j) for j in range(i, i + 20))}) + "\n"
                            for i in range(5)))
    return str(path)


def _merge_argv(tmp: Path, _):
    for i in range(2):
        _dataset(str(tmp / f"part{i}"))
    return ["--input", str(tmp / "part0"), str(tmp / "part1"), "--output-prefix", str(tmp / "out" / "all")]


def _out_merge(tmp: Path) -> list[Path]:
    (tmp / "out").mkdir(exist_ok=True)
    return [tmp / "out"]


NULL_TOK = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "63"]

CASES: dict[str, Case] = {
    "tools/build_default_corpus.py": Case(
        lambda tmp, _: ["--output-dir", str(tmp / "corpus"), "--max-mb", "0.02", "--workers", "1"],
        _tokenizer_training, lambda tmp: [tmp / "corpus"]),
    "tools/convert_checkpoint.py": Case(
        lambda tmp, ck: ["reshard", "--load", ck, "--save", str(tmp / "resharded"),
                         "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"],
        lambda mp, mod, exc: mp.setattr(mod, "reshard", _partial_then(
            exc, lambda load, staged, *a, **kw: (os.makedirs(staged, exist_ok=True), f"{staged}/x")[1])),
        lambda tmp: [tmp / "resharded"]),
    "tools/generate.py": Case(
        lambda tmp, ck: ["--load", ck, *NULL_TOK, "--prompt", "1 2 3", "--max-new-tokens", "2", "--greedy",
                         "--output-json", str(tmp / "out.json")],
        _json_dump, lambda tmp: [tmp / "out.json"]),
    "tools/merge_datasets.py": Case(_merge_argv, _writer_add("add_index"), _out_merge),
    "tools/plan.py": Case(
        lambda tmp, _: ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"],
        lambda mp, mod, exc: mp.setattr(mod, "plan_main", _raise(exc)), lambda tmp: []),
    "tools/plot_logs.py": Case(
        lambda tmp, _: [str(_log(tmp)), "--output", str(tmp / "plot.png")], _savefig,
        lambda tmp: [tmp / "plot.png"]),
    "tools/plot_pipeline_timeline.py": Case(
        lambda tmp, _: ["--pp", "2", "--microbatches", "2", "--output", str(tmp / "t.png")], _savefig,
        lambda tmp: [tmp / "t.png"]),
    "tools/preprocess_data.py": Case(
        lambda tmp, _: ["--input", _jsonl(tmp), "--output-prefix", str(tmp / "out" / "p"), *NULL_TOK],
        _writer_add("add_documents"), _out_merge),
    "tools/show_layout.py": Case(
        lambda tmp, _: ["--world-size", "8", "--tensor-model-parallel-size", "2"],
        lambda mp, mod, exc: mp.setattr(mod.RankLayout, "describe", _raise(exc)), lambda tmp: []),
    "tools/train_tokenizer.py": Case(
        lambda tmp, _: ["--input", _jsonl(tmp), "--output-dir", str(tmp / "new" / "tok"),
                         "--vocab-size", "300"],
        _tokenizer_training, lambda tmp: [tmp / "new" / "tok"]),
    "tasks/main.py": Case(
        lambda tmp, ck: ["--task", "WIKITEXT103", "--valid-data", str(_text(tmp)), "--load", ck, *NULL_TOK,
                         "--overlapping-eval", "8", "--results-json", str(tmp / "res.json")],
        _json_dump, lambda tmp: [tmp / "res.json"]),
}


def _log(tmp: Path) -> Path:
    path = tmp / "run.log"
    path.write_text("".join(f" iteration {i}/ 4 | lm loss: {5 - i}.0 | learning rate: 1.0E-04 |\n"
                            for i in range(1, 5)))
    return path


def _text(tmp: Path) -> Path:
    path = tmp / "wiki.txt"
    path.write_text(" ".join(str(i % 60) for i in range(40)))
    return path


def test_every_entry_point_has_a_case():
    assert sorted(entry_points()) == sorted(CASES), "a tool without a case: add one to CASES"


FAILURES = {"interrupt": (KeyboardInterrupt(), 130, "interrupted;"),
            "ENOSPC": (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "OUT"), None, os.strerror(errno.ENOSPC)),
            "EFBIG": (OSError(errno.EFBIG, os.strerror(errno.EFBIG), "OUT"), None, os.strerror(errno.EFBIG)),
            "EACCES": (OSError(errno.EACCES, os.strerror(errno.EACCES), "OUT"), None, os.strerror(errno.EACCES))}


def _leftovers(tmp: Path, before: set[Path], outputs: list[Path]) -> list[str]:
    """What the failed run left: any file or folder new under the work folder (a folder made for the output
    counts), and anything in an output."""
    now = set(tmp.rglob("*"))
    return sorted(str(p.relative_to(tmp)) for p in now - before)


@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("entry", sorted(CASES))
def test_a_failed_write_is_one_line_and_leaves_nothing(entry, failure, ckpt, tmp_path, monkeypatch, capsys):
    exc, status, said = FAILURES[failure]
    case = CASES[entry]
    argv = case.argv(tmp_path, ckpt)
    outputs = case.outputs(tmp_path)
    if isinstance(exc, OSError):
        exc = OSError(exc.errno, exc.strerror, str(tmp_path / "target"))
    mod = load(entry, monkeypatch)
    before = set(tmp_path.rglob("*"))
    capsys.readouterr()
    case.inject(monkeypatch, mod, exc)
    try:
        code = mod.main(argv)
    except BaseException as escaped:  # noqa: BLE001 - a traceback is the failure this test looks for
        pytest.fail(f"{entry} {failure}: {type(escaped).__name__} escaped main(): a traceback")
    err = capsys.readouterr().err
    name = Path(entry).name if entry != "tasks/main.py" else entry
    lines = [line for line in err.splitlines() if line.startswith(name) or "rror" in line]  # progress aside
    assert len(lines) == 1 and "Traceback" not in err and err.splitlines()[-1] == lines[0], (entry, failure, err)
    assert said in lines[0] and lines[0].startswith(name), lines
    if isinstance(exc, OSError):
        assert str(tmp_path / "target") in lines[0] and "[Errno" not in lines[0], lines[0]
    assert code == status if status is not None else code not in (0, None, 130), (entry, failure, code)
    assert _leftovers(tmp_path, before, outputs) == [], f"{entry} {failure} left partial output"


def test_a_real_file_size_limit_is_one_line_with_no_partial_output(tmp_path):
    """ulimit -f: SIGXFSZ would kill the tool without a word; it is ignored, so the write fails with EFBIG,
    said in one line, and the half-merged output is removed."""
    argv = _merge_argv(tmp_path, None)
    (tmp_path / "out").mkdir()
    before = set(tmp_path.rglob("*"))

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "merge_datasets.py"), *argv], capture_output=True,
                          text=True, preexec_fn=limit, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert len(lines) == 1 and os.strerror(errno.EFBIG) in lines[0], proc.stderr
    assert _leftovers(tmp_path, before, []) == []


def test_a_real_permission_refusal_is_one_line(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root is never refused")
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o500)
    try:
        proc = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_pipeline_timeline.py"), "--pp", "2",
                               "--microbatches", "2", "--output", str(out / "t.png")], capture_output=True, text=True,
                              timeout=120)
    finally:
        out.chmod(0o700)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert os.strerror(errno.EACCES) in lines[0] and str(out) in lines[0], lines
    assert list(out.iterdir()) == []


def _terminal_sigint() -> None:
    """The child's Ctrl-C as in a terminal: a suite started in the background by a non-interactive shell has
    SIGINT ignored, which every child inherits (and a Python started so keeps ignoring it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_real_ctrl_c_of_preprocess_with_workers_is_one_line(tmp_path):
    """SIGINT to the whole process group (as a terminal's Ctrl-C sends it) once the first progress line is
    out: the parent says it in one line and exits 130, the workers print nothing, no output is left."""
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": " ".join(str((i + j) % 60) for j in range(30))}) + "\n"
                              for i in range(100_000)))
    proc = subprocess.Popen([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(source),
                             "--output-prefix", str(tmp_path / "out"), *NULL_TOK, "--workers", "2",
                             "--log-interval", "1000"], stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_terminal_sigint)
    try:
        first = proc.stderr.readline()
        assert first.startswith("Processed"), first
        os.killpg(proc.pid, signal.SIGINT)
        try:
            rest = proc.communicate(timeout=120)[1]
        except subprocess.TimeoutExpired:
            pytest.fail("preprocess_data.py did not end after Ctrl-C (its workers hang the pool)")
        code = proc.returncode
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    said = [line for line in rest.splitlines() if line.strip() and not line.startswith("Processed")]
    assert code == 130 and len(said) == 1 and said[0].startswith("preprocess_data.py: interrupted;"), rest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
