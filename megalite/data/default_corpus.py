"""A real text corpus every machine with Python already has: the standard library's source code and
its docstrings. It lets a newcomer train on real text with no download.

``ensure_default_corpus(dir)`` builds, once: ``stdlib.jsonl`` (one document per module's source and
one per module's docstrings), a byte-level BPE tokenizer trained on it (``vocab.json``,
``merges.txt``, ``tokenizer.json``) and the preprocessed ``stdlib_text_document.bin/.idx``.

The build is deterministic for a given Python version (files in sorted order, fixed tokenizer
training), so processes racing to build the same folder write identical files; each file is written
under a temporary name and renamed, the ``.idx`` last, so a half-built corpus is never used.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import sysconfig
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator

from megalite.launch.tool_errors import first_existing, remove_created

PREFIX = "stdlib"
DATA_NAME = f"{PREFIX}_text_document"
VOCAB_SIZE = 8192
# Test suites and codec tables are skipped: they are repetitive and not the prose/code we want.
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings",
             "lib2to3", "turtledemo", "ensurepip"}


def stdlib_files(root: str | None = None) -> list[str]:
    """The standard library's ``.py`` files, relative to ``root``, sorted."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith((".", "test_"))]
        rel = os.path.relpath(dirpath, root)
        for f in filenames:
            if f.endswith(".py") and not f.startswith("test_"):
                out.append(os.path.normpath(os.path.join(rel, f)).replace(os.sep, "/"))
    return sorted(out)


def _docstrings(source: str) -> list[str]:
    """Module, class and function docstrings in source order (parsed, never imported)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences in old modules
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            return []
    nodes = [tree] + [n for n in ast.walk(tree)
                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    out = []
    for n in nodes:
        doc = ast.get_docstring(n, clean=True)
        if doc and len(doc) > 40:
            title = "" if isinstance(n, ast.Module) else f"{n.name}:\n"
            out.append(title + doc)
    return out


def iter_documents(max_bytes: int | None = None, root: str | None = None) -> Iterator[dict]:
    """Corpus documents: each module's source, then its docstrings as prose (deterministic order)."""
    root = root or sysconfig.get_paths()["stdlib"]
    total = 0
    for rel in stdlib_files(root):
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            source = f.read()
        docs = [{"text": source, "source": rel, "kind": "source"}] if source.strip() else []
        prose = _docstrings(source)
        if prose:
            docs.append({"text": "\n\n".join(prose), "source": rel, "kind": "docstrings"})
        for d in docs:
            if max_bytes is not None and total >= max_bytes:
                return
            total += len(d["text"].encode("utf-8"))
            yield d


def corpus_paths(directory: str) -> dict[str, str]:
    return {
        "data_path": os.path.join(directory, DATA_NAME),
        "vocab_file": os.path.join(directory, "vocab.json"),
        "merge_file": os.path.join(directory, "merges.txt"),
    }


def is_built(directory: str) -> bool:
    paths = corpus_paths(directory)
    return all(os.path.isfile(p) for p in (paths["vocab_file"], paths["merge_file"],
                                           paths["data_path"] + ".bin", paths["data_path"] + ".idx"))


def build_default_corpus(directory: str, *, max_bytes: int | None = None, vocab_size: int = VOCAB_SIZE,
                         workers: int = 2, log: Callable[[str], None] | None = None) -> dict[str, str]:
    """Build the corpus into ``directory`` (replacing what is there); returns ``corpus_paths``."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    existed = first_existing(directory)
    os.makedirs(directory, exist_ok=True)
    try:
        _build_into(directory, max_bytes, vocab_size, workers, log)
    except BaseException:
        remove_created(directory, existed)  # the folders this build made, when nothing was written in them
        raise
    return corpus_paths(directory)


def _build_into(directory: str, max_bytes: int | None, vocab_size: int, workers: int,
                log: Callable[[str], None]) -> None:
    from megalite.data.preprocess import PreprocessOptions, preprocess
    from megalite.data.tokenizer_training import train_bpe

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as tmp:
        jsonl = os.path.join(tmp, f"{PREFIX}.jsonl")
        texts = []
        with open(jsonl, "w", encoding="utf-8") as f:
            for doc in iter_documents(max_bytes):
                f.write(json.dumps(doc, ensure_ascii=False) + "\n")
                texts.append(doc["text"])
        log(f"corpus: {len(texts)} documents, {os.path.getsize(jsonl) / 2**20:.1f} MB of jsonl "
            f"({time.perf_counter() - t0:.1f} s)")
        tok = train_bpe(texts, vocab_size, tmp)
        del texts
        log(f"corpus: trained a {vocab_size}-token byte-level BPE ({time.perf_counter() - t0:.1f} s)")
        preprocess(PreprocessOptions(
            inputs=[jsonl], output_prefix=os.path.join(tmp, PREFIX), append_eod=True,
            workers=max(1, min(workers, os.cpu_count() or 1)), log_interval=1 << 30,
            tokenizer={"tokenizer_type": "GPT2BPETokenizer", "vocab_file": tok["vocab_file"],
                       "merge_file": tok["merge_file"]}), log=lambda _msg: None)
        # Tokenizer and jsonl first, then the data with its .idx last: the .idx marks a complete corpus.
        names = ["vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", f"{PREFIX}.jsonl",
                 f"{DATA_NAME}.bin", f"{DATA_NAME}.idx"]
        final_idx = os.path.join(directory, f"{DATA_NAME}.idx")
        if os.path.exists(final_idx):
            os.unlink(final_idx)
        for name in names:
            os.replace(os.path.join(tmp, name), os.path.join(directory, name))
    log(f"corpus: built {corpus_paths(directory)['data_path']} in {time.perf_counter() - t0:.1f} s")


def ensure_default_corpus(directory: str, **kwargs) -> dict[str, str]:
    """Paths of the default corpus in ``directory`` (``data_path``, ``vocab_file``, ``merge_file``),
    building it first if it is missing."""
    if not is_built(directory):
        build_default_corpus(directory, **kwargs)
    return corpus_paths(directory)

