"""The shape of a checkpoint's metadata.json and of an optimizer file's ``meta``, checked before use: valid
JSON of the wrong shape (a list, a missing key, a string where a number belongs) is named by file and
key instead of surfacing later as a KeyError or TypeError far from the file."""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from typing import Any

from megalite.checkpointing.errors import CheckpointError
from megalite.config.model import ModelConfig
from megalite.config.strict_load import StrictReadError, load_json

INT, COUNT, SIZE = "an integer", "an integer >= 0", "an integer >= 1"
LAYOUT_KEYS = {"tp": SIZE, "pp": SIZE, "dp": SIZE, "vp": SIZE}  # required; the others may be absent (older)
LAYOUT_OPTIONAL = {"cp": SIZE, "ep": SIZE, "etp": SIZE}
STATE_COUNTS = ("iteration", "consumed_samples", "valid_consumed", "skipped_iterations", "nan_iterations")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _kind_ok(v: Any, kind: str) -> bool:
    if not _is_int(v):
        return False
    return kind == INT or (kind == COUNT and v >= 0) or (kind == SIZE and v >= 1)


class _Where:
    """Raises errors naming the file and the key path."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, key: str, why: str) -> typing.NoReturn:
        raise CheckpointError(f"{self.path}: {key} {why}; the file is damaged or was not written by megalite")

    def section(self, meta: dict[str, Any], key: str, optional: bool = False) -> dict[str, Any]:
        if key not in meta:
            if optional:
                return {}
            self.fail(f"key {key!r}", "is missing")
        if optional and meta[key] is None:
            return {}
        if not isinstance(meta[key], dict):
            self.fail(key, f"is {type(meta[key]).__name__} {meta[key]!r:.40}, expected an object")
        return meta[key]

    def number(self, section: dict[str, Any], prefix: str, key: str, kind: str, optional: bool = False) -> None:
        if key not in section:
            if not optional:
                self.fail(f"key {prefix}{key!r}", "is missing")
            return
        if not _kind_ok(section[key], kind):
            self.fail(f"{prefix}{key}", f"is {section[key]!r:.40}, expected {kind}")


def _field_ok(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a ModelConfig field's annotation (int, float, bool, str, list[X], X | None)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list:
        return isinstance(value, list) and all(_field_ok(v, args[0]) for v in value)
    if args:  # X | None
        return any(_field_ok(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return _is_int(value)
    if hint is float:
        return _is_int(value) or isinstance(value, float)
    if hint is str:
        return isinstance(value, str)
    return True


def _check_config(w: _Where, config: dict[str, Any]) -> None:
    w.number(config, "config.", "vocab_size", SIZE)
    hints = typing.get_type_hints(ModelConfig)
    for f in dataclasses.fields(ModelConfig):
        if f.name in config and not _field_ok(config[f.name], hints[f.name]):
            w.fail(f"config.{f.name}", f"is {config[f.name]!r:.40}, expected {hints[f.name]}")


def check_metadata(meta: Any, path: str) -> dict[str, Any]:
    """``meta`` (a parsed metadata.json) if it has the keys and types megalite reads; else CheckpointError
    naming ``path`` and the first wrong key (a key written twice is refused as it is read: load_metadata)."""
    w = _Where(path)
    if not isinstance(meta, dict):
        w.fail("the top level", f"is {type(meta).__name__}, expected an object")
    w.number(meta, "", "iteration", COUNT)
    w.number(meta, "", "format_version", INT, optional=True)
    layout = w.section(meta, "layout")
    for key, kind in LAYOUT_KEYS.items():
        w.number(layout, "layout.", key, kind)
    for key, kind in LAYOUT_OPTIONAL.items():
        w.number(layout, "layout.", key, kind, optional=True)
    if layout.get("world_size") is not None:
        w.number(layout, "layout.", "world_size", SIZE)
    if not isinstance(layout.get("order", ""), str):
        w.fail("layout.order", f"is {layout['order']!r:.40}, expected a string")
    if not isinstance(layout.get("distributed_optimizer", False), bool):
        w.fail("layout.distributed_optimizer", f"is {layout['distributed_optimizer']!r:.40}, expected true/false")
    _check_chunk_layers(w, layout)
    _check_config(w, w.section(meta, "config"))
    state = w.section(meta, "state")
    for key in STATE_COUNTS:
        w.number(state, "state.", key, COUNT, optional=True)
    w.section(state, "loss_scaler", optional=True)
    checksums = w.section(meta, "checksums", optional=True)
    for key, value in checksums.items():
        if not isinstance(value, str):
            w.fail(f"checksums[{key!r}]", f"is {value!r:.40}, expected a string")
    for key, value in w.section(meta, "tokenizer", optional=True).items():  # file paths, a type, a vocab size
        if value is not None and not isinstance(value, (str, int)) or isinstance(value, bool):
            w.fail(f"tokenizer.{key}", f"is {value!r:.40}, expected a string, a number or null")
    return meta


def _check_chunk_layers(w: "_Where", layout: dict[str, Any]) -> None:
    """layout.chunk_layers (absent in older checkpoints): per pipeline rank, per model chunk, its global
    layer numbers."""
    ranks = layout.get("chunk_layers", [])
    ok = isinstance(ranks, list) and all(
        isinstance(chunks, list) and all(isinstance(c, list) and all(type(i) is int and i >= 0 for i in c)
                                         for c in chunks) for chunks in ranks)
    if not ok:
        w.fail("layout.chunk_layers", f"is {ranks!r:.40}, expected per rank a list of chunks' layer numbers")


def load_metadata(path: str) -> dict[str, Any]:
    """metadata.json at ``path``, parsed and checked (CheckpointError naming the file otherwise)."""
    try:
        with open(path, "rb") as f:
            meta = load_json(f.read().decode("utf-8"), path)
    except StrictReadError as e:
        raise CheckpointError(str(e)) from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:  # binary bytes, truncated or not JSON
        raise CheckpointError(f"{path} is corrupt: {e}") from None
    except RecursionError:
        raise CheckpointError(f"{path} is corrupt: nested too deeply") from None
    return check_metadata(meta, path)


def check_optim_meta(raw: Any, path: str) -> dict[str, Any]:
    """The ``meta`` of an optimizer file (its regions and Adam step), parsed and checked."""
    w = _Where(f"{path} (its safetensors metadata)")
    if not isinstance(raw, dict) or not isinstance(raw.get("meta"), str):
        w.fail("key 'meta'", "is missing")
    try:
        meta = json.loads(raw["meta"])
    except (json.JSONDecodeError, RecursionError) as e:
        w.fail("'meta'", f"is not JSON ({e})")
    if not isinstance(meta, dict):
        w.fail("'meta'", f"is {type(meta).__name__}, expected an object")
    if not _is_number(meta.get("step")) or meta["step"] < 0:
        w.fail("meta.step", f"is {meta.get('step')!r:.40}, expected a finite number >= 0")
    for key, region in w.section(meta, "regions").items():
        ok = (isinstance(region, list) and len(region) == 3 and _kind_ok(region[0], COUNT)
              and _kind_ok(region[1], COUNT) and region[0] <= region[1] and isinstance(region[2], list)
              and all(_kind_ok(d, COUNT) for d in region[2]))
        if ok:
            numel = math.prod(region[2])
            ok = region[1] <= numel
        if not ok:
            w.fail(f"meta.regions[{key!r}]", f"is {region!r:.60}, expected [lo, hi, shape] with 0 <= lo <= hi <= numel")
    return meta
