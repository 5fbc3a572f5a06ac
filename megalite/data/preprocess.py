"""Text -> Megatron ``.bin/.idx``: the engine behind ``tools/preprocess_data.py``.

The main process reads input chunks in order and writes the outputs; ``workers`` processes parse
JSON and tokenize whole chunks at once (the tokenizer's batch path). At most ``2 * workers + 1``
chunks are in flight, so memory stays flat on any input size, and results are consumed in input
order, so the output does not depend on the number of workers.

A document whose text is a list of strings becomes one sequence per non-empty string (as Megatron
does for split sentences); ``--append-eod`` adds the eod token to the document's last sequence; an
empty text gives an empty document.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from megalite.config.strict_load import StrictReadError, load_json_line
from megalite.data.errors import MissingFileError, UnwritableError
from megalite.data.indexed_dataset import IndexedDatasetWriter, token_dtype
from megalite.data.inputs import Chunk, InputError, check_inputs, iter_chunks, resolve_inputs
from megalite.data.tokenizer import build_tokenizer


@dataclass
class PreprocessOptions:
    inputs: list[str]
    output_prefix: str
    tokenizer: dict  # DataConfig-style tokenizer fields: tokenizer_type, vocab_file, ...
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    append_eod: bool = False
    workers: int = 1
    log_interval: int = 1000
    skip_bad_lines: bool = False


@dataclass
class Encoded:
    """One chunk's result, per json key: flat tokens, sequence lengths, sequences per document."""

    tokens: dict[str, np.ndarray]
    seq_lengths: dict[str, np.ndarray]
    seqs_per_doc: dict[str, np.ndarray]
    num_docs: int
    nbytes: int
    bad: list[tuple[str, int, str]]  # (source, row, reason)


@dataclass
class PreprocessResult:
    outputs: dict[str, str]  # json key -> output prefix
    num_docs: int
    num_tokens: int
    skipped: list[tuple[str, int, str]]
    seconds: float


_STATE: dict = {}


def _init_pool_worker(tokenizer_fields: dict, json_keys: list[str], append_eod: bool) -> None:
    """A tokenizing worker: Ctrl-C (sent to the whole process group) is the parent's to say, in one line; the
    workers end with the pool instead of each printing a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(tokenizer_fields, json_keys, append_eod)


def _init_worker(tokenizer_fields: dict, json_keys: list[str], append_eod: bool) -> None:
    """Per-process state: the tokenizer and what to encode."""
    names = ("tokenizer_type", "vocab_size", "vocab_file", "merge_file", "tokenizer_model")
    tok = build_tokenizer(SimpleNamespace(**{k: tokenizer_fields.get(k) for k in names}))
    _STATE.update(tokenizer=tok, keys=json_keys, append_eod=append_eod, dtype=token_dtype(tok.vocab_size))


def _row_texts(obj, keys: list[str]) -> tuple[dict[str, list[str]] | None, str | None]:
    """The strings of each key of one row, or a reason the row is bad."""
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    out = {}
    for k in keys:
        if k not in obj:
            return None, f"missing key {k!r}"
        v = obj[k]
        if isinstance(v, str):
            out[k] = [v]
        elif isinstance(v, list) and all(isinstance(s, str) for s in v):
            out[k] = v
        else:
            return None, f"key {k!r} holds {type(v).__name__}, expected a string or a list of strings"
    return out, None


def _parse(chunk: Chunk, keys: list[str]):
    """Rows of a chunk as (row number, {key: [strings]}), plus the bad rows."""
    rows, bad = [], []
    if chunk.lines is not None:
        for i, line in enumerate(chunk.lines):
            if not line.strip():
                continue
            row = chunk.first_row + i
            try:
                obj = load_json_line(line, "row")
            except UnicodeDecodeError as e:
                bad.append((chunk.source, row, f"not UTF-8 text (byte {e.start} of the line: {e.reason})"))
                continue
            except StrictReadError as e:  # a key twice (json.loads would keep the last), or nested too deep
                bad.append((chunk.source, row, str(e).removeprefix("row: ")))
                continue
            except ValueError as e:
                bad.append((chunk.source, row, f"malformed JSON ({e})"))
                continue
            texts, reason = _row_texts(obj, keys)
            if reason:
                bad.append((chunk.source, row, reason))
            else:
                rows.append((row, texts))
    else:
        n = len(next(iter(chunk.columns.values())))
        for i in range(n):
            texts, reason = _row_texts({k: chunk.columns[k][i] for k in keys}, keys)
            if reason:
                bad.append((chunk.source, chunk.first_row + i, reason))
            else:
                rows.append((chunk.first_row + i, texts))
    return rows, bad


class _BadRow(Exception):
    def __init__(self, row: int, reason: str) -> None:
        super().__init__(reason)
        self.row, self.reason = row, reason


def _culprit(rows, key: str, tok, test: Callable[[list[int]], str | None]) -> _BadRow:
    """The first row whose ``key`` text fails to tokenize or whose tokens fail ``test``."""
    for row, texts in rows:
        for s in texts[key]:
            try:
                reason = test(tok.tokenize(s))
            except Exception as e:  # e.g. a non-integer word for NullTokenizer
                reason = f"cannot tokenize {key!r}: {e}"
            if reason:
                return _BadRow(row, reason)
    return _BadRow(rows[0][0], f"cannot tokenize {key!r}")


def _encode_rows(rows, tok, keys: list[str], append_eod: bool, dtype):
    vocab = tok.vocab_size

    def out_of_vocab(ids: list[int]) -> str | None:
        bad = [i for i in ids if not 0 <= i < vocab]
        return f"token id {bad[0]} outside the vocabulary [0, {vocab})" if bad else None

    tokens, seq_lengths, seqs_per_doc = {}, {}, {}
    for key in keys:
        try:
            ids = tok.tokenize_batch([s for _, texts in rows for s in texts[key]])
        except Exception:
            raise _culprit(rows, key, tok, lambda _: None) from None
        pieces, lengths, counts = [], [], []
        it = iter(ids)
        for _, texts in rows:
            doc_lengths = []
            for _ in texts[key]:
                piece = next(it)
                if piece:
                    pieces.append(piece)
                    doc_lengths.append(len(piece))
            if doc_lengths and append_eod:
                pieces.append([tok.eod])
                doc_lengths[-1] += 1
            lengths += doc_lengths
            counts.append(len(doc_lengths))
        total = sum(lengths)
        arr = np.fromiter((t for p in pieces for t in p), dtype=np.int64, count=total)
        if total and (arr.min() < 0 or arr.max() >= vocab):
            raise _culprit(rows, key, tok, out_of_vocab)
        tokens[key] = arr.astype(dtype)
        seq_lengths[key] = np.asarray(lengths, dtype=np.int32)
        seqs_per_doc[key] = np.asarray(counts, dtype=np.int64)
    return tokens, seq_lengths, seqs_per_doc


def encode_chunk(chunk: Chunk) -> Encoded:
    """Parse and tokenize one chunk (runs in a worker). Bad rows are dropped and reported."""
    tok, keys, append_eod, dtype = (_STATE[k] for k in ("tokenizer", "keys", "append_eod", "dtype"))
    rows, bad = _parse(chunk, keys)
    while True:
        try:
            tokens, lengths, counts = _encode_rows(rows, tok, keys, append_eod, dtype)
            break
        except _BadRow as e:
            bad.append((chunk.source, e.row, e.reason))
            rows = [r for r in rows if r[0] != e.row]
    bad.sort(key=lambda b: b[1])
    return Encoded(tokens, lengths, counts, len(rows), chunk.nbytes, bad)


def _ordered_results(chunks: Iterator[Chunk], pool, workers: int) -> Iterator[Encoded]:
    """Chunk results in input order with a bounded number in flight."""
    pending: deque = deque()
    for chunk in chunks:
        pending.append(pool.apply_async(encode_chunk, (chunk,)))
        if len(pending) > 2 * workers:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


@contextlib.contextmanager
def _ended(pool, others: set) -> Iterator[None]:
    """The workers end with the run. On a failure or Ctrl-C they are killed at once and the pool's own shutdown
    gets a few seconds on a background thread: ``Pool.terminate`` can wait forever for a queue lock a worker
    held, and an interrupted run must always exit (one line, no output left). ``others``: the caller's children
    from before the pool, left alone."""
    try:
        yield
    except BaseException:
        for p in set(multiprocessing.active_children()) - others:
            p.kill()
        stopper = threading.Thread(target=pool.terminate, daemon=True)
        stopper.start()
        stopper.join(timeout=5)
        raise
    pool.terminate()  # every result is in: as ``with pool`` ended it


def _mp_context():
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else None)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def check_output_prefix(prefix: str) -> None:
    """The folder of ``--output-prefix`` exists and takes a file (a probe written and removed), so a bad
    output fails before any tokenizing rather than after it."""
    folder = os.path.dirname(os.path.abspath(prefix))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise MissingFileError(f"--output-prefix {prefix}: {folder} is a file, not a directory")
    if not os.path.isdir(folder):
        raise MissingFileError(f"--output-prefix {prefix}: output directory {folder} does not exist (create it "
                               "first)")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".preprocess-probe-"):
            pass
    except OSError as e:
        raise UnwritableError(f"--output-prefix {prefix}: cannot write in {folder} ({e.strerror})") from None


def preprocess(opts: PreprocessOptions, log: Callable[[str], None] = _stderr) -> PreprocessResult:
    """Tokenize ``opts.inputs`` into ``{output_prefix}_{key}_document.bin/.idx`` per json key.

    Raises :class:`InputError` (a ValueError) with ``file:line: reason`` for a bad row unless
    ``skip_bad_lines``; empty input or an unwritable output fails before any tokenizing.
    """
    if opts.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {opts.workers}")
    if opts.log_interval < 1:
        raise ValueError(f"--log-interval must be at least 1, got {opts.log_interval}")
    check_output_prefix(opts.output_prefix)
    sources = resolve_inputs(opts.inputs)
    check_inputs(sources, opts.json_keys)
    _init_worker(opts.tokenizer, opts.json_keys, opts.append_eod)  # validates the tokenizer flags here
    dtype = _STATE["dtype"]
    outputs = {k: f"{opts.output_prefix}_{k}_document" for k in opts.json_keys}
    writers: dict[str, IndexedDatasetWriter] = {}
    try:
        for key, prefix in outputs.items():
            writers[key] = IndexedDatasetWriter(prefix, dtype)
        result = _run(opts, sources, writers, log)
        for w in writers.values():  # every index written before any output appears: one key's output
            w.write_index()  # never stands alone after a later key's failed on a full disk
        for w in writers.values():
            w.publish()
        result.outputs = outputs
        return result
    finally:
        for w in writers.values():
            w.__exit__(None, None, None)  # discards partial files unless finalized


def _run(opts, sources, writers, log) -> PreprocessResult:
    start = time.perf_counter()
    docs = tokens = nbytes = 0
    skipped: list[tuple[str, int, str]] = []
    next_log = opts.log_interval
    ctx = _mp_context()
    # One tokenizer thread per worker: the workers are the parallelism. Set while the workers start
    # (they inherit it), then restored so the caller's own tokenizer keeps its threads.
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    others = set(multiprocessing.active_children())
    try:
        pool = ctx.Pool(opts.workers, initializer=_init_pool_worker,
                        initargs=(opts.tokenizer, opts.json_keys, opts.append_eod))
    finally:
        if previous is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous
    with _ended(pool, others):
        for enc in _ordered_results(iter_chunks(sources, opts.json_keys), pool, opts.workers):
            if enc.bad and not opts.skip_bad_lines:
                src, row, reason = enc.bad[0]
                raise InputError(f"{src}:{row}: {reason} (--skip-bad-lines skips such lines)")
            skipped += enc.bad
            for key, w in writers.items():
                w.add_documents(enc.tokens[key], enc.seq_lengths[key], enc.seqs_per_doc[key])
                tokens += len(enc.tokens[key])
            docs += enc.num_docs
            nbytes += enc.nbytes
            if docs >= next_log:
                elapsed = max(time.perf_counter() - start, 1e-9)
                log(f"Processed {docs} documents ({docs / elapsed:.1f} docs/s, "
                    f"{nbytes / elapsed / 2**20:.2f} MB/s).")
                next_log = (docs // opts.log_interval + 1) * opts.log_interval
    seconds = time.perf_counter() - start
    if docs == 0:
        raise InputError(f"no documents: every row of {', '.join(sources)} was bad or blank")
    log(f"Done: {docs} documents, {tokens} tokens in {seconds:.2f} s "
        f"({tokens / max(seconds, 1e-9):,.0f} tokens/s, {nbytes / max(seconds, 1e-9) / 2**20:.2f} MB/s).")
    if skipped:
        src, row, reason = skipped[0]
        log(f"Skipped {len(skipped)} bad lines; first: {src}:{row}: {reason}")
    return PreprocessResult({}, docs, tokens, skipped, seconds)
