"""Argparse flags generated from config dataclasses.

Each dataclass field becomes ``--field-name`` (underscores to dashes) unless its metadata gives
``flag``. The field's ``help`` metadata is the flag's help text, so the dataclass is the one place a
flag is documented. Booleans are ``store_true`` switches; a bool field defaulting to True gets a
``--no-...`` switch instead (its metadata names it via ``flag``, and its help says what the switch does:
turn the feature off). ``list[...]`` fields take ``nargs='+'`` (their ``choices`` apply to each value); one
with ``scalar=True`` also takes a single value in a --config file (``cp_comm_type: p2p``: every layer).
Every int and float field declares its ``Domain`` (config/domain.py): the help states it, and
``domain_errors`` checks a config against every field's domain (validate runs it first).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from typing import Any

from megalite.config.domain import Domain


def option(default: Any = dataclasses.MISSING, help: str = "", flag: str | None = None,
           choices: typing.Sequence[Any] | None = None, domain: Domain | None = None, scalar: bool = False,
           **kw: Any) -> Any:
    """A dataclass field carrying its flag's documentation (and, for a number, its domain). ``scalar``: a
    list field whose --config value may also be one element (a list of it)."""
    meta: dict[str, Any] = {"help": help}
    if scalar:
        meta["scalar"] = True
    if domain is not None:
        meta["domain"] = domain
    if flag:
        meta["flag"] = flag
    if choices is not None:
        meta["choices"] = list(choices)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta, **kw)
    return dataclasses.field(default=default, metadata=meta, **kw)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a config class (resolving them is slow; a parser asks per field)."""
    return typing.get_type_hints(cls)


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


def numeric(tp: Any) -> type | None:
    """int or float for a numeric field (or a list of them), else None."""
    if typing.get_origin(tp) is list:
        tp = typing.get_args(tp)[0]
    return tp if tp in (int, float) else None


def field_domain(cls: type, f: dataclasses.Field) -> Domain | None:
    """A numeric field's declared domain; a numeric field without one is a programming error."""
    tp, _ = _unwrap(_hints(cls)[f.name])
    if numeric(tp) is None:
        return None
    domain = f.metadata.get("domain")
    if not isinstance(domain, Domain):
        raise TypeError(f"{cls.__name__}.{f.name} is a number: its option() must declare domain=Domain(...)")
    return domain


def domain_of(cls: type, name: str) -> tuple[Domain, bool]:
    """(the domain of field ``name`` of ``cls``, whether it is an integer): for a tool's option that
    takes the same value as a config flag (convert_checkpoint.py's layout flags)."""
    f = cls.__dataclass_fields__[name]
    domain = field_domain(cls, f)
    if domain is None:
        raise TypeError(f"{cls.__name__}.{name} is not a number")
    return domain, numeric(_unwrap(_hints(cls)[name])[0]) is int


@functools.cache
def _domains(cls: type) -> tuple[tuple[str, str, Domain | None, bool], ...]:
    """(field name, flag, domain or None for a non-number, integer) of every field of ``cls``."""
    out = []
    for f in dataclasses.fields(cls):
        tp, _ = _unwrap(_hints(cls)[f.name])
        out.append((f.name, flag_name(f), field_domain(cls, f), numeric(tp) is int))
    return tuple(out)


def domain_errors(cfg: Any) -> list[str]:
    """Every field of the config dataclass ``cfg`` (and of the sections it holds) checked against its
    domain, one message per value outside, naming the flag and the rule. Unset optional fields pass."""
    errors: dict[str, list[str]] = {}
    for name, flag, domain, integer in _domains(type(cfg)):
        value = getattr(cfg, name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            errors[name] = domain_errors(value)
        elif domain is not None and value is not None:
            values = value if isinstance(value, list) else [value]
            errors[name] = [e for v in values if (e := domain.error(flag, v, integer))]
    # A default derived from other fields (ModelConfig.DERIVED) is named with its sources, and not at all
    # when a source is itself out of its domain (its own message says what to fix).
    derived = getattr(cfg, "derived_fields", set())  # a value the user wrote is named as written
    for name, (sources, how) in getattr(type(cfg), "DERIVED", {}).items():
        if name not in derived:
            continue
        if errors.get(name) and any(errors.get(src) for src in sources):
            errors[name] = []
        elif errors.get(name):
            errors[name] = [f"{e} (its default is {how})" for e in errors[name]]
    return [e for found in errors.values() for e in found]


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, title: str | None = None) -> None:
    """Add one flag per field of ``cls`` to ``parser`` (defaults are SUPPRESSed so that
    a value can be told apart from an unset flag when merging with ``--config`` files)."""
    group = parser.add_argument_group(title or cls.__name__, (cls.__doc__ or "").strip().split("\n")[0])
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("flag") == "":
            continue
        tp, _ = _unwrap(hints[f.name])
        name = flag_name(f)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        help_text = f.metadata.get("help", "")
        domain = field_domain(cls, f)
        if domain is not None:
            help_text += f" [{domain.describe(numeric(tp) is int)}]"
        if default not in (None, [], False) and tp is not bool:
            help_text += f" (default: {' '.join(map(str, default)) if isinstance(default, list) else default})"
        kw: dict[str, Any] = dict(dest=f.name, help=help_text, default=argparse.SUPPRESS)
        if tp is bool:
            # A True default is turned off by a --no-... flag named in the metadata.
            group.add_argument(name, action="store_false" if default else "store_true", **kw)
            continue
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        if typing.get_origin(tp) is list:
            (elem,) = typing.get_args(tp)
            group.add_argument(name, nargs="+", type=elem, **kw)
            continue
        group.add_argument(name, type=tp, **kw)


def field_types(cls: type) -> dict[str, Any]:
    hints = _hints(cls)
    return {f.name: _unwrap(hints[f.name])[0] for f in dataclasses.fields(cls)}


def field_specs(cls: type) -> dict[str, tuple[Any, bool, list | None, bool]]:
    """{field name: (type, accepts None, choices or None, a list that takes one element alone)}: what a
    --config file value must be."""
    hints = _hints(cls)
    return {f.name: (*_unwrap(hints[f.name]), f.metadata.get("choices"), bool(f.metadata.get("scalar")))
            for f in dataclasses.fields(cls)}
