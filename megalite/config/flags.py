"""Argparse flags generated from config dataclasses.

Each dataclass field becomes ``--field-name`` (underscores to dashes) unless its metadata gives
``flag``. The field's ``help`` metadata is the flag's help text, so the dataclass is the one place a
flag is documented. Booleans are ``store_true`` switches; a bool field defaulting to True gets a
``--no-...`` switch instead (its metadata names it via ``flag``, and its help says what the switch does:
turn the feature off). ``list[...]`` fields take
``nargs='+'``.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any


def option(default: Any = dataclasses.MISSING, help: str = "", flag: str | None = None,
           choices: typing.Sequence[Any] | None = None, **kw: Any) -> Any:
    """A dataclass field carrying its flag's documentation."""
    meta = {"help": help}
    if flag:
        meta["flag"] = flag
    if choices is not None:
        meta["choices"] = list(choices)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta, **kw)
    return dataclasses.field(default=default, metadata=meta, **kw)


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """Return (inner type, is_optional) for ``X | None``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, title: str | None = None) -> None:
    """Add one flag per field of ``cls`` to ``parser`` (defaults are SUPPRESSed so that
    a value can be told apart from an unset flag when merging with ``--config`` files)."""
    group = parser.add_argument_group(title or cls.__name__, (cls.__doc__ or "").strip().split("\n")[0])
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("flag") == "":
            continue
        tp, _ = _unwrap(hints[f.name])
        name = flag_name(f)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        help_text = f.metadata.get("help", "")
        if default not in (None, [], False) and tp is not bool:
            help_text += f" (default: {default})"
        kw: dict[str, Any] = dict(dest=f.name, help=help_text, default=argparse.SUPPRESS)
        if tp is bool:
            # A True default is turned off by a --no-... flag named in the metadata.
            group.add_argument(name, action="store_false" if default else "store_true", **kw)
            continue
        if typing.get_origin(tp) is list:
            (elem,) = typing.get_args(tp)
            group.add_argument(name, nargs="+", type=elem, **kw)
            continue
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        group.add_argument(name, type=tp, **kw)


def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: _unwrap(hints[f.name])[0] for f in dataclasses.fields(cls)}


def field_specs(cls: type) -> dict[str, tuple[Any, bool, list | None]]:
    """{field name: (type, accepts None, choices or None)}: what a --config file value must be."""
    hints = typing.get_type_hints(cls)
    return {f.name: (*_unwrap(hints[f.name]), f.metadata.get("choices")) for f in dataclasses.fields(cls)}
