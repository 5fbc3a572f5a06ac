"""The one reader of the JSON and YAML files a user hands megalite (--config, --deepspeed-config, Hugging
Face config.json and tokenizer files, JSONL rows, Megatron's metadata.json, task data lines): a key written
twice in one mapping is refused, naming both lines; nesting deeper than ``MAX_DEPTH`` is refused by name
(Python's readers recurse, so a deep document would end in a RecursionError); a YAML document whose aliases
expand past ``MAX_YAML_VALUES`` values is refused (a kilobyte of nested aliases, "billion laughs", would
otherwise keep every walk over the document busy for ever).

JSON leaves duplicate keys undefined and YAML forbids them, yet both standard readers keep the last one
without a word, so a setting the user wrote can be silently replaced. Here every mapping's keys are
checked as it is read, at any depth, and the line of every key is kept (``*_with_lines``) so that later
errors about a value can name the line it was written on.
"""

from __future__ import annotations

import bisect
import json
import json.decoder
import json.scanner
import re
from typing import Any

KeyPath = tuple[str, ...]
MAX_DEPTH = 100  # nested lists/objects: a config or tokenizer file needs under ten
MAX_YAML_VALUES = 100_000  # values of a YAML document once its aliases are expanded


class StrictReadError(ValueError):
    """A JSON or YAML document this reader refuses (the message names the file and the rule)."""


class DuplicateKeyError(StrictReadError):
    """A mapping in a JSON or YAML file names one key twice."""


class NestingError(StrictReadError):
    """A document nested deeper than ``MAX_DEPTH``."""


class AliasExpansionError(StrictReadError):
    """A YAML document whose aliases expand past ``MAX_YAML_VALUES`` values (or refer to themselves)."""


def _too_deep(name: str) -> NestingError:
    return NestingError(f"{name}: nested deeper than {MAX_DEPTH} levels of lists/objects: not a file megalite reads")


def check_depth(doc: Any, name: str, limit: int = MAX_DEPTH) -> None:
    """Refuse a parsed document nested deeper than ``limit`` (an explicit stack: no recursion)."""
    stack = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > limit:
                raise _too_deep(name)
            items = value.values() if isinstance(value, dict) else value
            stack.extend((v, depth + 1) for v in items if isinstance(v, (dict, list)))


def _dotted(path: KeyPath, key: str) -> str:
    return ".".join((*path, key))


def _duplicate(name: str, path: KeyPath, key: str, first: int, second: int) -> DuplicateKeyError:
    return DuplicateKeyError(f"{name}: key '{_dotted(path, key)}' is written twice (lines {first} and "
                             f"{second}): keep one")


class _JsonLines:
    """A JSON decoder whose objects check their keys: the pure-Python scanner with parse_object wrapped, so
    each object sees where its values start (a key sits on its value's line). An object only knows the key
    paths below itself; its parent prefixes them once the object is placed under a key."""

    def __init__(self, text: str, name: str) -> None:
        self.text, self.name = text, name
        self._newlines = [m.start() for m in re.finditer("\n", text)]
        self.decoder = json.JSONDecoder()
        self.decoder.parse_object = self._parse_object
        self.decoder.scan_once = json.scanner.py_make_scanner(self.decoder)
        # id(object) -> (the object, {relative key path: line}, the first duplicate found below it)
        self._info: dict[int, tuple[dict, dict[KeyPath, int], tuple | None]] = {}

    def _parse_object(self, s_and_end, strict, scan_once, object_hook, object_pairs_hook, memo=None):
        starts: list[int] = []

        def scan(s: str, idx: int):
            starts.append(idx)
            return scan_once(s, idx)

        pairs, end = json.decoder.JSONObject(s_and_end, strict, scan, None, lambda p: p,
                                             memo if memo is not None else {})
        lines: dict[KeyPath, int] = {}
        dup: tuple | None = None
        for (key, value), start in zip(pairs, starts):
            line = bisect.bisect_left(self._newlines, start) + 1
            if (key,) in lines and dup is None:
                dup = ((), key, lines[(key,)], line)
            lines[(key,)] = line
            dup = self._adopt(value, (key,), lines, dup)
        obj = dict(pairs)
        self._info[id(obj)] = (obj, lines, dup)
        return obj, end

    def _adopt(self, value: Any, prefix: KeyPath, lines: dict[KeyPath, int], dup: tuple | None) -> tuple | None:
        """Copy the key lines (and the first duplicate) of the objects inside ``value`` under ``prefix``."""
        if isinstance(value, list):
            for i, item in enumerate(value):
                dup = self._adopt(item, (*prefix, str(i)), lines, dup)
        elif isinstance(value, dict) and id(value) in self._info:
            _, inner, inner_dup = self._info.pop(id(value))
            lines.update({(*prefix, *k): v for k, v in inner.items()})
            if dup is None and inner_dup is not None:
                dup = ((*prefix, *inner_dup[0]), *inner_dup[1:])
        return dup

    def load(self) -> tuple[Any, dict[KeyPath, int]]:
        data = self.decoder.decode(self.text)
        lines: dict[KeyPath, int] = {}
        dup = self._adopt(data, (), lines, None)
        if dup is not None:
            raise _duplicate(self.name, *dup)
        return data, lines


def load_json_with_lines(text: str, name: str) -> tuple[Any, dict[KeyPath, int]]:
    """(the document, {key path: line}); raises StrictReadError or json.JSONDecodeError."""
    try:
        doc, lines = _JsonLines(text, name).load()
    except RecursionError:
        raise _too_deep(name) from None
    check_depth(doc, name)
    return doc, lines


class _Repeated(Exception):
    """A duplicate seen by the fast reader; the line-tracking reader then names it."""


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _Repeated
    return obj


def load_json(text: str, name: str) -> Any:
    """The document of ``text`` (read from ``name``, for messages), duplicate keys refused. The C reader
    checks (a GPT-2 vocab.json takes it a tenth of a second); only a file with a duplicate is read again
    by the line-tracking reader, to name the lines."""
    try:
        doc = json.loads(text, object_pairs_hook=_no_repeats)
    except _Repeated:
        return load_json_with_lines(text, name)[0]
    except RecursionError:
        raise _too_deep(name) from None
    check_depth(doc, name)
    return doc


def load_json_line(text: str | bytes, name: str) -> Any:
    """One JSONL row (``name`` says which, for messages): a key written twice is refused naming the key
    (a row is one line, so no line numbers); depth bounded as in ``load_json``."""

    def no_repeats(pairs: list[tuple[str, Any]]) -> dict:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            seen: set[str] = set()
            key = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise DuplicateKeyError(f"{name}: key '{key}' is written twice in one row: keep one")
        return obj

    try:
        doc = json.loads(text, object_pairs_hook=no_repeats)
    except RecursionError:
        raise _too_deep(name) from None
    check_depth(doc, name)
    return doc


def load_yaml_with_lines(text: str, name: str) -> tuple[Any, dict[KeyPath, int]]:
    """(the document, {key path: line}) of YAML ``text`` read safely; raises StrictReadError or
    yaml.YAMLError."""
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise _too_deep(name) from None
        lines: dict[KeyPath, int] = {}
        if node is not None:
            _check_yaml_node(node, name, lines)
        return (loader.construct_document(node) if node is not None else None), lines
    finally:
        loader.dispose()


def _check_yaml_node(root: Any, name: str, lines: dict[KeyPath, int]) -> None:
    """Duplicate keys, depth and the aliases' expansion of the composed document, walked with an
    explicit stack and a budget of values, so nested or self-referring aliases end in a named error."""
    import yaml

    stack: list[tuple[Any, KeyPath]] = [(root, ())]
    budget = MAX_YAML_VALUES
    while stack:
        node, path = stack.pop()
        budget -= 1
        if budget < 0:
            raise AliasExpansionError(f"{name}: its aliases (*name) expand to more than {MAX_YAML_VALUES} values "
                                      f"(aliases nested in aliases, or one inside itself): write the values out")
        if len(path) >= MAX_DEPTH:
            raise _too_deep(name)
        if isinstance(node, yaml.SequenceNode):
            stack.extend(reversed([(item, (*path, str(i))) for i, item in enumerate(node.value)]))
        elif isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], int] = {}
            children = []
            for key_node, value_node in node.value:
                line = key_node.start_mark.line + 1
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                    ident = (key_node.tag, key_node.value)
                    if ident in seen:
                        raise _duplicate(name, path, key_node.value, seen[ident], line)
                    seen[ident] = line
                    lines[(*path, key_node.value)] = line
                children.append((value_node, (*path, str(getattr(key_node, "value", "?")))))
            stack.extend(reversed(children))


def load_yaml(text: str, name: str) -> Any:
    """The document of YAML ``text`` (read from ``name``, for messages), duplicate keys refused."""
    return load_yaml_with_lines(text, name)[0]
