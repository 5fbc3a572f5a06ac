"""A --config YAML/JSON file: parsed with the file and line named, every value checked against its
dataclass field's type with the key named (no coercion: a YAML string where a number belongs is
an error, not a guess)."""

from __future__ import annotations

import difflib
import json
import typing
from pathlib import Path
from typing import Any


class ConfigFileError(ValueError):
    """A --config file that cannot be read, or a key or value in it that does not fit."""


def _parse(path: str) -> Any:
    p = Path(path)
    if not p.is_file():
        raise ConfigFileError(f"--config: file {path} does not exist")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigFileError(f"--config: cannot read {path}: {e}") from None
    if p.suffix in (".yaml", ".yml"):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
            where = f"{path}, line {mark.line + 1}" if mark is not None else path
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigFileError(f"--config: malformed YAML in {where}: {problem}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigFileError(f"--config: malformed JSON in {path}, line {e.lineno}: {e.msg}") from None


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is list:
        elem = typing.get_args(tp)[0]
        return "a list of " + {int: "integers", float: "numbers", str: "strings"}.get(elem, str(elem))
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _fits(value: Any, tp: Any) -> bool:
    if typing.get_origin(tp) is list:
        (elem,) = typing.get_args(tp)
        return isinstance(value, list) and all(_fits(v, elem) for v in value)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, tp)


def _hint(value: Any, tp: Any) -> str:
    """Why a plausible-looking value did not fit, and how to write it."""
    if isinstance(value, str) and tp in (int, float):
        try:
            float(value)
        except ValueError:
            return ""
        return " (YAML reads a number like 1e-3 without a dot as a string: write 1.0e-3)"
    if isinstance(value, str) and typing.get_origin(tp) is list:
        return f" (write a list: [{value}])"
    if isinstance(value, str) and tp is bool:
        return " (write true or false, unquoted)"
    return ""


def check_value(key: str, value: Any, tp: Any, optional: bool, choices: list | None) -> Any:
    """``value`` if it fits field ``key`` of type ``tp``; an int given for a float field becomes a float."""
    if value is None:
        if optional:
            return None
        raise ConfigFileError(f"--config: '{key}' cannot be null: it expects {_type_name(tp)}")
    if not _fits(value, tp):
        raise ConfigFileError(f"--config: '{key}' expects {_type_name(tp)}, got {type(value).__name__} "
                              f"{value!r}{_hint(value, tp)}")
    if choices is not None and value not in choices:
        raise ConfigFileError(f"--config: '{key}' must be one of {', '.join(map(str, choices))}, got {value!r}")
    return float(value) if tp is float else value


def did_you_mean(name: str, known: typing.Iterable[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def load_config_file(path: str, sections: dict[str, type], fields: dict[str, tuple[Any, bool, list | None]]
                     ) -> dict[str, Any]:
    """{field name: checked value} from a flat or section-nested file; ``fields`` maps each field name
    to (type, optional, choices)."""
    data = _parse(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config: {path} must hold a mapping of flag names to values, "
                              f"got {type(data).__name__}")
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in sections and isinstance(value, dict):
            flat.update({str(k).replace("-", "_"): (f"{key}.{k}", v) for k, v in value.items()})
        else:
            flat[str(key).replace("-", "_")] = (str(key), value)
    out = {}
    for name, (key, value) in flat.items():
        if name not in fields:
            raise ConfigFileError(f"--config: {path}: unknown key '{key}'{did_you_mean(name, fields)}")
        out[name] = check_value(key, value, *fields[name])
    return out
