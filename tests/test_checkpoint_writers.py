"""Promises of every writer of a checkpoint folder (one rule, checkpointing/destination.py), enumerated:
every convert_checkpoint.py subcommand (to-megatron in both formats, from-megatron from both) and training
(pretrain_gpt.py's guarded save). For each:
- a --save that is the source, holds it or lies inside it, by its own path, a symlink or another alias, is
  refused in one line naming both flags, --overwrite or not, and the source is untouched (training writes in
  place and removes nothing of its --load: there --save = --load is a resume, and the source stays as it was);
- a --save held by a live run (or inside one, or holding one when replaced) is refused naming the holder,
  whose files are untouched;
- of two writers into one new folder one wins and the other is refused: the folder holds the winner's
  output and nothing else, no staging folder is left;
- the tool: Ctrl-C, a full disk, a file-size limit mid-write are one line (status 130 / 2, no traceback),
  and the destination is as it was (absent, or its earlier contents)."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import resource
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors import SafetensorError
from torch.distributed.checkpoint.api import CheckpointException

from megalite.checkpointing import destination
from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.guard import guarded_save
from megalite.checkpointing.lock import SaveLock
from megalite.checkpointing.metadata import config_dict
from megalite.checkpointing.paths import TRACKER, iter_dirname
from megalite.checkpointing.stored import named_params
from megalite.checkpointing.writer import write_checkpoint
from megalite.config import validate
from megalite.config.arguments import MegaliteConfig
from megalite.config.model import ModelConfig
from megalite.model.gpt import GPTModel
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.random import RNGTracker
from megalite.training.loop import pretrain
from tests.cli_utils import load_tool, tree_hash
from tests.tp_utils import LLAMA_GQA, mock_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "convert_checkpoint.py")
VOCAB = 64
MODEL = {**LLAMA_GQA, "num_layers": 2, "hidden_size": 16, "num_attention_heads": 4, "num_query_groups": 2}
tool = load_tool("convert_checkpoint")

WRITE_FULL = "write_full" if hasattr(tool, "write_full") else "write_checkpoint"  # the importers' writer
# Every conversion: name -> (the source it reads, its argv without --load/--save, the tool's function that
# writes the output, and which of that function's positional arguments is the folder it writes).
CONVERSIONS = {
    "reshard": ("megalite", ["reshard", "--tensor-model-parallel-size", "2"], "reshard", 1),
    "to-hf": ("megalite", ["to-hf"], "save_hf_model", 0),
    "to-megatron torch_dist": ("megalite", ["to-megatron", "--format", "torch_dist"], "save_torch_dist", 0),
    "to-megatron torch": ("megalite", ["to-megatron", "--format", "torch"], "save_legacy", 0),
    "from-hf": ("hf", ["from-hf"], WRITE_FULL, 0),
    "from-megatron torch_dist": ("megatron torch_dist", ["from-megatron"], WRITE_FULL, 0),
    "from-megatron torch": ("megatron torch", ["from-megatron"], WRITE_FULL, 0),
}
WRITERS = [*CONVERSIONS, "training"]
# Where a checkpoint folder is written from, found by grepping megalite/, tools/ and pretrain_gpt.py for the
# low-level writers' callers: each either claims its destination itself or is called under a claim.
CALLERS = {
    "tools/convert_checkpoint.py": "every subcommand claims --save (destination.claim + replacing)",
    "megalite/training/resume.py": "training's saves, under pretrain_gpt.py's guarded_save (destination.claim)",
    "megalite/checkpointing/reshard.py": "the library reshard(), called by convert_checkpoint.py reshard",
    "megalite/checkpointing/writer.py": "write_checkpoint / write_full themselves (commit their own staging folder)",
    "megalite/checkpointing/save.py": "save_checkpoint itself (commits its own staging folder)",
}
LOW_LEVEL = re.compile(r"(?<![\w.])(?:\w+\.)?(write_checkpoint|write_full|save_checkpoint|save_hf_model|"
                       r"save_torch_dist|save_legacy|reshard|commit|swap_into_place)\(")


def _shapes() -> dict[str, tuple[int, ...]]:
    ctx = BuildContext(ProcessGroups.single(), RNGTracker(), device=torch.device("meta"))
    model = GPTModel(ModelConfig(**MODEL), ctx, VOCAB)
    return {k: tuple(p.shape) for n, k, p in named_params([model]) if n == k}


def _quiet_main(argv: list[str]) -> tuple[int, str]:
    """convert_checkpoint.py's main in this process: (status, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = tool.main(argv)
    return rc, err.getvalue()


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    """One tiny source of each kind the conversions read."""
    root = str(tmp_path_factory.mktemp("sources"))
    shapes, g = _shapes(), torch.Generator().manual_seed(0)
    out = {"megalite": os.path.join(root, "megalite")}
    write_checkpoint(out["megalite"], config_dict(ModelConfig(**MODEL), VOCAB),
                     lambda k: torch.randn(shapes[k], generator=g), tp=1, pp=1, iteration=2)
    for kind, argv in (("hf", ["to-hf"]), ("megatron torch_dist", ["to-megatron", "--format", "torch_dist"]),
                       ("megatron torch", ["to-megatron", "--format", "torch"])):
        out[kind] = os.path.join(root, kind.replace(" ", "_"))
        rc, err = _quiet_main([argv[0], "--load", out["megalite"], "--save", out[kind], *argv[1:]])
        assert rc == 0, err
    return out


def _fresh(sources: dict[str, str], kind: str, where: str) -> str:
    """A copy of the source ``kind`` at ``where`` (a test may only damage its own copy)."""
    shutil.copytree(sources[kind], where)
    return where


def convert(name: str, src: str, dest: str, *extra: str) -> tuple[int, str]:
    argv = CONVERSIONS[name][1]
    return _quiet_main([argv[0], "--load", src, "--save", dest, *argv[1:], *extra])


def train(src: str, dest: str, *, before: contextlib.AbstractContextManager | None = None) -> None:
    """pretrain_gpt.py's writer: its guarded save start-up, then one iteration from ``src`` saved into ``dest``
    (``before`` entered while the run holds its folder, before it trains)."""
    cfg = MegaliteConfig.from_flat(dict(
        MODEL, micro_batch_size=1, global_batch_size=1, train_iters=3, lr=1e-3, lr_warmup_iters=0,
        log_interval=10, eval_iters=0, eval_interval=1000, mock_data=True, vocab_size=VOCAB, seed=1,
        load=src, save=dest, no_load_optim=True))
    validate(cfg, 1)
    with guarded_save(cfg.checkpoint, cfg.model, 0, lambda s: None), before or contextlib.nullcontext():
        pretrain(cfg, ProcessGroups.single(), data=mock_data(VOCAB, MODEL["seq_length"], 1, 8), log=lambda s: None)


def write(name: str, src: str, dest: str, *extra: str) -> str | None:
    """Run writer ``name`` from ``src`` into ``dest``: None when it wrote, else its one-line error."""
    if name == "training":
        try:
            train(src, dest)
        except CheckpointError as e:
            return str(e)
        return None
    rc, err = convert(name, src, dest, *extra)
    assert rc in (0, 2), err
    assert rc == 0 or err.count("\n") == 1 and "Traceback" not in err, err
    return None if rc == 0 else err


def _source_kind(name: str) -> str:
    return "megalite" if name == "training" else CONVERSIONS[name][0]


def _siblings(folder: str) -> list[str]:
    """What lies beside ``folder`` apart from the test's own entries (staging leftovers)."""
    parent = os.path.dirname(os.path.abspath(folder))
    return sorted(n for n in os.listdir(parent) if n.startswith("."))


# ---- the enumeration is complete -----------------------------------------------------------------


def test_every_subcommand_and_every_writer_is_enumerated():
    parser = tool.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert sorted(sub.choices) == sorted({argv[0] for _, argv, _, _ in CONVERSIONS.values()})
    fmt = next(a for a in sub.choices["to-megatron"]._actions if a.dest == "format")
    assert {f"to-megatron {f}" for f in fmt.choices} <= set(CONVERSIONS)
    found = set()
    for top in ("megalite", "tools", "pretrain_gpt.py"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)) if top != "pretrain_gpt.py" else [(ROOT, [], [top])]:
            for f in (f for f in files if f.endswith(".py")):
                path = os.path.join(dirpath, f)
                for line in open(path, encoding="utf-8"):
                    if LOW_LEVEL.search(line) and not line.lstrip().startswith(("def ", "#", '"""')):
                        found.add(os.path.relpath(path, ROOT))
    assert found - {"megalite/checkpointing/paths.py"} == set(CALLERS), "a new writer of checkpoint folders: " \
        "make it claim its destination (destination.claim) and list it here"


# ---- a destination that is, holds or lies inside the source ---------------------------------------------

CASES = ["is", "is by a symlink", "contains", "contains by a symlink", "lies inside", "lies inside by a symlink"]


def _layout(tmp_path, sources: dict[str, str], kind: str, case: str) -> tuple[str, str]:
    """(source, destination) standing to each other as ``case`` says; the source at outer/src."""
    src = _fresh(sources, kind, str(tmp_path / "outer" / "src"))
    link = str(tmp_path / "link")
    if case.startswith("contains"):
        os.symlink(str(tmp_path / "outer"), link)
        return src, link if case.endswith("symlink") else str(tmp_path / "outer")
    os.symlink(src, link)
    via = link if case.endswith("symlink") else src
    return src, via if case.startswith("is") else os.path.join(via, "out")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", WRITERS)
def test_a_destination_aliasing_the_source_never_loses_it(tmp_path, sources, name, case):
    src, dest = _layout(tmp_path, sources, _source_kind(name), case)
    before = tree_hash(src)
    kept = os.path.join(src, iter_dirname(2))
    kept_hash = tree_hash(kept) if os.path.isdir(kept) else None
    err = write(name, src, dest, "--overwrite")
    if name == "training":  # in place: a resume (or a save beside / below it) that removes nothing of --load
        assert err is None
        assert tree_hash(kept) == kept_hash
        return
    assert err is not None and "--save" in err and "--load" in err, err
    assert ("must differ from --load" if case.startswith("is") else case.split()[0]) in err
    assert tree_hash(src) == before
    assert not os.path.exists(os.path.join(src, "out"))
    assert _siblings(src) == []


def test_identity_is_compared_by_inode_too(tmp_path, monkeypatch):
    """Where two paths do not resolve to one (a bind mount), the device and inode still tell."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    os.symlink(src, tmp_path / "alias")
    monkeypatch.setattr(destination.os.path, "realpath", os.path.abspath)  # the alias no longer resolves
    assert destination.relation(str(tmp_path / "alias"), str(src)) == "is"
    assert destination.relation(str(tmp_path / "alias" / "sub" / "new"), str(src)) == "lies inside"
    assert destination.relation(str(tmp_path / "alias"), str(src / "sub")) == "contains"
    assert destination.relation(str(tmp_path / "other"), str(src)) is None


# ---- live runs' folders -----------------------------------------------------------------------------


@contextlib.contextmanager
def _live_run(folder: str):
    """A run (this process) holding ``folder``'s lock, with a checkpoint-like file of its own there."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, TRACKER), "w") as f:
        f.write("7")
    lock = SaveLock(folder)
    lock.acquire(lambda s: None)
    try:
        yield
    finally:
        lock.release()


@pytest.mark.parametrize("where", ["is", "inside", "holds"])
@pytest.mark.parametrize("name", WRITERS)
def test_a_live_runs_folder_is_refused_and_untouched(tmp_path, sources, name, where):
    src = _fresh(sources, _source_kind(name), str(tmp_path / "src"))
    live = str(tmp_path / "outer" / "live")
    dest = {"is": live, "inside": os.path.join(live, "out"), "holds": str(tmp_path / "outer")}[where]
    if name == "training" and where == "holds":
        pytest.skip("training writes in place: it never removes a folder below its --save")
    with _live_run(live):
        before = tree_hash(live)
        err = write(name, src, dest, "--overwrite")
        assert err is not None and f"pid {os.getpid()}" in err, err
        assert tree_hash(live) == before
    out = os.path.join(live, "out")
    assert not os.path.exists(out) or name == "training" and os.listdir(out) == []  # its write probe's folder


# ---- two writers, one new folder ---------------------------------------------------------------------


@contextlib.contextmanager
def _calling(then):
    then()
    yield


@contextlib.contextmanager
def _while_writing(monkeypatch, name: str, then):
    """Writer ``name``'s run with ``then()`` called once in the middle of its write (a conversion: when its
    writer function is called; training: once it holds its folder, through the context it yields)."""
    if name == "training":
        yield _calling(then)
        return
    attr = CONVERSIONS[name][2]
    real, calls = getattr(tool, attr), []

    def writing(*args, **kwargs):
        if not calls:
            calls.append(then())
        return real(*args, **kwargs)

    monkeypatch.setattr(tool, attr, writing)
    yield None


def _files(folder: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


# Each writer against itself and against training (training against a conversion), second while first writes.
PAIRS = [(w, w) for w in WRITERS] + [(w, "training") for w in CONVERSIONS] + [("training", "reshard")]


@pytest.mark.parametrize("first,second", PAIRS)
def test_two_writers_into_one_new_folder_one_wins(tmp_path, sources, monkeypatch, first, second):
    src1 = _fresh(sources, _source_kind(first), str(tmp_path / "src1"))
    src2 = _fresh(sources, _source_kind(second), str(tmp_path / "src2"))
    alone = str(tmp_path / "ref" / "alone")
    assert write(first, src1, alone) is None
    dest = str(tmp_path / "out" / "new")
    refused: list[str | None] = []
    with _while_writing(monkeypatch, first, lambda: refused.append(write(second, src2, dest))) as during:
        if first == "training":
            train(src1, dest, before=during)
        else:
            rc, err = convert(first, src1, dest)
            assert rc == 0, err
    assert refused and refused[0] is not None and "in use by another run" in refused[0], refused
    assert _files(dest) == _files(alone)
    assert _siblings(dest) == []


# ---- the tool: interrupts and system errors mid-write ----------------------------------------------------

FAILURES = {
    "interrupt": (KeyboardInterrupt(), 130, "interrupted; nothing written"),
    "full disk": (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), 2, os.strerror(errno.ENOSPC)),
    "file-size limit": (OSError(errno.EFBIG, os.strerror(errno.EFBIG)), 2, os.strerror(errno.EFBIG)),
    "permission": (PermissionError(errno.EACCES, os.strerror(errno.EACCES)), 2, os.strerror(errno.EACCES)),
    # the same, wrapped as the libraries raise them
    "full disk in safetensors": (SafetensorError("Error while serializing: I/O error: No space left on device "
                                                 "(os error 28)"), 2, os.strerror(errno.ENOSPC)),
    "file-size limit in torch_dist": (CheckpointException("ranks", {0: (OSError(errno.EFBIG, "File too large"), None)}),
                                      2, os.strerror(errno.EFBIG)),
    "interrupt in torch_dist": (CheckpointException("ranks", {0: (KeyboardInterrupt(), None)}), 130,
                                "interrupted; nothing written"),
}


@pytest.mark.parametrize("earlier", ["none", "a folder replaced with --overwrite"])
@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("name", CONVERSIONS)
def test_a_failed_write_is_one_line_and_leaves_the_destination_as_it_was(tmp_path, sources, monkeypatch, name,
                                                                        failure, earlier):
    src = _fresh(sources, CONVERSIONS[name][0], str(tmp_path / "src"))
    dest = str(tmp_path / "out")
    if earlier != "none":
        os.makedirs(dest)
        (tmp_path / "out" / "earlier.txt").write_text("kept")
    exc, status, said = FAILURES[failure]
    _, _, attr, pos = CONVERSIONS[name]

    def failing(*args, **kwargs):
        folder = args[pos]
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "partial.bin"), "wb") as f:
            f.write(b"\0" * 100)
        raise exc

    monkeypatch.setattr(tool, attr, failing)
    extra = ["--overwrite"] if earlier != "none" else []
    argv = CONVERSIONS[name][1]
    rc, err = _quiet_main([argv[0], "--load", src, "--save", dest, *argv[1:], *extra])
    assert rc == status and err.count("\n") == 1 and "Traceback" not in err and said in err, err
    if status != 130:
        assert dest in err
    assert (sorted(os.listdir(dest)) == ["earlier.txt"]) if earlier != "none" else not os.path.exists(dest)
    assert _siblings(dest) == []


def _limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, not a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


@pytest.mark.parametrize("name", ["to-megatron torch", "reshard"])
def test_a_real_file_size_limit_is_one_line(tmp_path, sources, name):
    """A process under a file-size limit (ulimit -f): the libraries' own write errors, not a simulation."""
    src = _fresh(sources, CONVERSIONS[name][0], str(tmp_path / "src"))
    dest = str(tmp_path / "out")
    argv = CONVERSIONS[name][1]
    proc = subprocess.run([sys.executable, TOOL, argv[0], "--load", src, "--save", dest, *argv[1:]],
                          capture_output=True, text=True, timeout=120, preexec_fn=_limit_file_size)
    err = proc.stderr
    assert proc.returncode == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert dest in err and os.strerror(errno.EFBIG) in err, err
    assert not os.path.exists(dest) and _siblings(dest) == []


def test_restarting_in_place_compares_folders_not_strings(tmp_path):
    """--load naming --save through a symlink or another spelling is the same folder: the run that restarts
    in place sets a damaged newest checkpoint aside (fallback.py) whichever spelling it was given."""
    from megalite.checkpointing.guard import restarts_in_place
    from megalite.config.training import CheckpointConfig

    real = tmp_path / "run"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    other = tmp_path / "other"
    other.mkdir()
    assert restarts_in_place(CheckpointConfig(save=str(real), load=str(link)))
    assert restarts_in_place(CheckpointConfig(save=str(real), load=f"{tmp_path}/./run/"))
    assert not restarts_in_place(CheckpointConfig(save=str(real), load=str(other)))
    assert not restarts_in_place(CheckpointConfig(save=str(real), load=str(link), finetune=True))
