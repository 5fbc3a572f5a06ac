"""Reading preprocessing inputs as ordered chunks of rows: jsonl (optionally .gz), parquet, arrow, and
folders saved by Hugging Face ``datasets``.

Rows keep their file and line/row number so a bad one can be named. The order is deterministic: files
in the order given, a glob's or folder's matches sorted by name, rows in file order.
"""

from __future__ import annotations

import glob
import gzip
import os
from collections.abc import Iterator
from dataclasses import dataclass

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson")
TABLE_SUFFIXES = (".parquet", ".arrow")


class InputError(ValueError):
    """Bad preprocessing input; the message names the file (and line) and the reason."""


@dataclass
class Chunk:
    """Consecutive rows of one source. ``lines`` holds raw jsonl lines; ``columns`` holds already
    parsed values per json key (table formats)."""

    source: str
    first_row: int  # 1-based line or row number of the first row
    lines: list[bytes] | None = None
    columns: dict[str, list] | None = None

    @property
    def nbytes(self) -> int:
        if self.lines is not None:
            return sum(len(x) for x in self.lines)
        return sum(len(v) for col in self.columns.values() for v in col if isinstance(v, str))


def _is_hf_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, "state.json"))
                                   or os.path.isfile(os.path.join(path, "dataset_dict.json")))


def _readable(name: str) -> bool:
    return name.endswith(JSONL_SUFFIXES + TABLE_SUFFIXES)


def resolve_inputs(patterns: list[str]) -> list[str]:
    """Expand globs and folders into an ordered list of sources (files, or saved-dataset folders)."""
    out: list[str] = []
    for pattern in patterns:
        if any(c in pattern for c in "*?["):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise InputError(f"--input {pattern!r} matches no files")
        else:
            if not os.path.exists(pattern):
                raise InputError(f"--input {pattern}: no such file or directory")
            matches = [pattern]
        for m in matches:
            if _is_hf_saved_dataset(m):
                out.append(m)
            elif os.path.isdir(m):
                found = sorted(os.path.join(root, f) for root, _, files in os.walk(m) for f in files
                               if _readable(f))
                if not found:
                    raise InputError(f"--input {m}: folder holds no .jsonl/.json(.gz)/.parquet/.arrow files "
                                     f"and is not a saved Hugging Face dataset")
                out.extend(found)
            else:
                out.append(m)
    return out


def _open_text(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _kind(path: str) -> str:
    if _is_hf_saved_dataset(path):
        return "hf"
    if path.endswith(".parquet"):
        return "parquet"
    if path.endswith(".arrow"):
        return "arrow"
    return "jsonl"


def _load_saved_dataset(path: str):
    import datasets

    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        raise InputError(f"--input {path} holds splits {sorted(ds)}; point --input at one split's folder "
                         f"(e.g. {os.path.join(path, sorted(ds)[0])})")
    return ds


def _arrow_reader(path: str):
    import pyarrow as pa

    try:
        return pa.ipc.open_stream(pa.memory_map(path))
    except pa.ArrowInvalid:
        return pa.ipc.open_file(pa.memory_map(path))


def table_columns(path: str) -> list[str]:
    """The table's column names; a name given to two columns is refused (arrow then reads one of them
    without a word, as a JSON reader keeps one of two equal keys)."""
    kind = _kind(path)
    if kind == "hf":
        names = list(_load_saved_dataset(path).column_names)
    elif kind == "parquet":
        import pyarrow.parquet as pq

        names = list(pq.ParquetFile(path).schema_arrow.names)
    else:
        names = list(_arrow_reader(path).schema.names)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise InputError(f"{path}: column {twice[0]!r} is in the schema twice (columns: {', '.join(names)}): "
                         f"keep one")
    return names


def check_inputs(sources: list[str], json_keys: list[str]) -> None:
    """Fail before any tokenizing when there is nothing to read or a table lacks a key."""
    any_rows = False
    for src in sources:
        kind = _kind(src)
        if kind == "jsonl":
            try:
                with _open_text(src) as f:
                    any_rows = any_rows or any(line.strip() for line in f)
            except (OSError, EOFError) as e:
                raise InputError(f"{src}: cannot read ({e})") from e
            continue
        try:
            columns = table_columns(src)
        except InputError:
            raise
        except Exception as e:  # pyarrow / datasets raise many types for unreadable files
            raise InputError(f"{src}: cannot read as {kind} ({e})") from e
        missing = [k for k in json_keys if k not in columns]
        if missing:
            raise InputError(f"{src}: no column {missing[0]!r} (columns: {', '.join(columns)})")
        any_rows = any_rows or _num_rows(src) > 0
    if not any_rows:
        raise InputError(f"input is empty: no rows in {', '.join(sources)}")


def _num_rows(path: str) -> int:
    kind = _kind(path)
    if kind == "hf":
        return len(_load_saved_dataset(path))
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    return sum(b.num_rows for b in _arrow_reader(path))


def iter_chunks(sources: list[str], json_keys: list[str], chunk_bytes: int = 1 << 20,
                chunk_rows: int = 2048) -> Iterator[Chunk]:
    """Chunks of about ``chunk_bytes`` (jsonl) or ``chunk_rows`` rows (tables), in input order."""
    for src in sources:
        kind = _kind(src)
        if kind == "jsonl":
            with _open_text(src) as f:
                row = 1
                while True:
                    try:
                        lines = f.readlines(chunk_bytes)
                    except (OSError, EOFError) as e:
                        raise InputError(f"{src}: read error after line {row - 1} ({e})") from e
                    if not lines:
                        break
                    yield Chunk(src, row, lines=lines)
                    row += len(lines)
        elif kind == "hf":
            ds = _load_saved_dataset(src).select_columns(json_keys)
            for start in range(0, len(ds), chunk_rows):
                batch = ds[start:start + chunk_rows]
                yield Chunk(src, start + 1, columns={k: batch[k] for k in json_keys})
        else:
            if kind == "parquet":
                import pyarrow.parquet as pq

                batches = pq.ParquetFile(src).iter_batches(batch_size=chunk_rows, columns=json_keys)
            else:
                batches = _arrow_reader(src)
            row = 1
            for batch in batches:
                cols = {k: batch.column(batch.schema.get_field_index(k)).to_pylist() for k in json_keys}
                n = batch.num_rows
                for start in range(0, n, chunk_rows):
                    part = {k: v[start:start + chunk_rows] for k, v in cols.items()}
                    yield Chunk(src, row + start, columns=part)
                row += n
