"""A --config YAML/JSON file: parsed with the file and line named, every value checked against its
dataclass field's type with the key and its line named (no coercion: a YAML string where a number
belongs is an error, not a guess); a setting written twice is refused, naming both lines."""

from __future__ import annotations

import difflib
import json
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megalite.config.strict_load import KeyPath, StrictReadError, load_json_with_lines, load_yaml_with_lines


class ConfigFileError(ValueError):
    """A --config file that cannot be read, or a key or value in it that does not fit."""


def read_text(flag: str, path: str) -> str:
    """The text of the file a flag names; a missing file, a directory or unreadable bytes are named."""
    p = Path(path)
    if p.is_dir():
        raise ConfigFileError(f"{flag}: {path} is a directory, not a file")
    if not p.is_file():
        raise ConfigFileError(f"{flag}: file {path} does not exist")
    try:
        return p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigFileError(f"{flag}: cannot read {path}: {e}") from None


def _parse(path: str) -> tuple[Any, dict[KeyPath, int]]:
    """(the document, {key path: line}); duplicate keys refused."""
    text = read_text("--config", path)
    try:
        if Path(path).suffix in (".yaml", ".yml"):
            import yaml

            try:
                return load_yaml_with_lines(text, path)
            except yaml.YAMLError as e:
                mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
                where = f"{path}, line {mark.line + 1}" if mark is not None else path
                problem = getattr(e, "problem", None) or str(e).splitlines()[0]
                raise ConfigFileError(f"--config: malformed YAML in {where}: {problem}") from None
        try:
            return load_json_with_lines(text, path)
        except json.JSONDecodeError as e:
            raise ConfigFileError(f"--config: malformed JSON in {path}, line {e.lineno}: {e.msg}") from None
    except StrictReadError as e:
        raise ConfigFileError(f"--config: {e}") from None


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


def check_value(key: str, value: Any, tp: Any, optional: bool, choices: list | None, scalar: bool = False) -> Any:
    """``value`` if it fits field ``key`` of type ``tp``; an int given for a float field becomes a float.
    ``scalar``: a list field that also takes one element (returned as a list of it). The choices of a list
    field apply to each element."""
    if value is None:
        if optional:
            return None
        raise ConfigFileError(f"--config: '{key}' cannot be null: it expects {_type_name(tp)}")
    is_list = typing.get_origin(tp) is list
    if scalar and is_list and _fits(value, typing.get_args(tp)[0]):
        value = [value]
    if not _fits(value, tp):
        expected = f"{_type_name(typing.get_args(tp)[0])} or {_type_name(tp)}" if scalar and is_list else _type_name(tp)
        raise ConfigFileError(f"--config: '{key}' expects {expected}, got {type(value).__name__} "
                              f"{value!r}{'' if scalar else _hint(value, tp)}")
    for v in value if is_list else [value]:
        if choices is not None and v not in choices:
            raise ConfigFileError(f"--config: '{key}' must be one of {', '.join(map(str, choices))}, got {v!r}")
    return float(value) if tp is float else value


def did_you_mean(name: str, known: typing.Iterable[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _flag_pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(?<![\w-])--{re.escape(name.replace('_', '-'))}(?![\w-])")


def name_written(message: str, written: dict[str, str]) -> str:
    """``message`` with each line that names a flag set from a file followed by where it was written."""
    if not written:
        return message
    patterns = {name: _flag_pattern(name) for name in written}
    out = []
    for line in message.splitlines():
        places = [written[n] for n, pat in patterns.items() if pat.search(line)]
        out.append(f"{line} (from {'; '.join(places)})" if places else line)
    return "\n".join(out)


@dataclass
class ConfigFileValues:
    """What a --config file sets: {field name: checked value}, and where each was written
    ({field name: "'model.hidden_size' in run.yaml, line 3"}) for messages about the value."""

    values: dict[str, Any]
    written: dict[str, str]


FieldSpec = tuple[Any, bool, list | None, bool]  # flags.field_specs: type, optional, choices, scalar


def load_config_file(path: str, sections: dict[str, type], fields: dict[str, FieldSpec]) -> ConfigFileValues:
    """The checked values of a flat or section-nested file; ``fields`` maps each field name to (type,
    optional, choices, whether a list field takes one element alone). A field set twice (flat and nested,
    or spelled with - and _) is refused."""
    data, lines = _parse(path)
    if data is None:
        return ConfigFileValues({}, {})
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config: {path} must hold a mapping of flag names to values, "
                              f"got {type(data).__name__}")
    flat: dict[str, tuple[str, Any, int]] = {}  # field name -> (key as written, value, line)
    for key, value in data.items():
        entries = ([((str(key), str(k)), v) for k, v in value.items()] if key in sections and isinstance(value, dict)
                   else [((str(key),), value)])
        for kpath, v in entries:
            name, written, line = kpath[-1].replace("-", "_"), ".".join(kpath), lines.get(kpath, 0)
            if name in flat:
                first, _, first_line = flat[name]
                raise ConfigFileError(f"--config: {path}: {name} is given twice: '{first}' (line {first_line}) and "
                                      f"'{written}' (line {line}): keep one")
            flat[name] = (written, v, line)
    out = ConfigFileValues({}, {})
    for name, (key, value, line) in flat.items():
        where = f"{path}, line {line}"
        if name not in fields:
            raise ConfigFileError(f"--config: {where}: unknown key '{key}'{did_you_mean(name, fields)}")
        try:
            out.values[name] = check_value(key, value, *fields[name])
        except ConfigFileError as e:
            raise ConfigFileError(str(e).replace("--config: ", f"--config: {where}: ", 1)) from None
        out.written[name] = f"'{key}' in {where}"
    return out
