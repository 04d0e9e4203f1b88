"""YAML and JSON from outside, read within bounds: every config, grid, thresholds and run-directory file.

A file lnstab reads is data, and data may be hostile or damaged. Before anything is built from it, each file is
checked against bounds that no honest file comes near, and a file past one is refused in one line naming the file
and the bound (:class:`DataFileError`):

* :data:`MAX_YAML_BYTES`, :data:`MAX_JSON_BYTES`: its size, checked before it is read;
* UTF-8: the text must decode strictly (the offset of the first bad byte is named);
* :data:`MAX_NUMBER_CHARS`: how long one number is written (a JSON number, a YAML plain scalar of digits): an
  integer of more digits than Python converts (4,300) would end in ``ValueError``, and one past a float's range
  (309 digits) in ``OverflowError`` wherever it meets a float, so no number lnstab reads is longer than a float's
  range allows;
* :data:`MAX_DEPTH`: how deeply mappings and sequences nest, counted over the parser's events (PyYAML's composer
  and ``json`` recurse, so a deep file would otherwise end in ``RecursionError``, or worse in libyaml's C code);
* :data:`MAX_NODES`: how many values a YAML document holds *with every alias expanded*. A "billion laughs" file
  (nine levels of ten aliases each) is a few hundred bytes, composes to a few dozen nodes, and expands to 10⁹
  values wherever it is walked (jsonargparse's namespaces, a dump, a deep copy). The count is taken on the composed
  node graph, memoised per node, so it costs one visit per distinct node however large the expansion; an alias
  inside the value it names (a cycle) is refused too. Strings that hold YAML themselves (jsonargparse parses a
  string value again where a type asks for a structure) are checked the same way.

:func:`bound_jsonargparse` puts the same check in front of jsonargparse's YAML loader, so the files and
command-line values that jsonargparse reads by itself (``--trainer trainer.yaml``, ``--trainer.plugins '[...]'``)
are bounded too.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from lnstab.errors import LNStabError

MAX_YAML_BYTES = 8 * 2**20
MAX_JSON_BYTES = 256 * 2**20  # hidden_stats.json of a long, deep run is tens of MB
MAX_DEPTH = 64
MAX_NODES = 100_000
MAX_NUMBER_CHARS = 300  # an integer of this many digits is still a finite float (at most 1.8e308)

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_YAML_NUMBER = re.compile(  # a plain scalar that YAML 1.1 may resolve to an int or a float
    r"[-+]?(0x[0-9a-fA-F_]+|0b[01_]+|[0-9][0-9_:]*(\.[0-9_]*)?([eE][-+]?[0-9]+)?|\.[0-9][0-9_]*([eE][-+]?[0-9]+)?)")
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')
_IN_STRING = " (YAML in a string of it)"
_OPEN = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
_CLOSE = (yaml.MappingEndEvent, yaml.SequenceEndEvent)


class DataFileError(LNStabError):
    """A file (or value) from outside that is not valid, or that breaks one of the bounds; one line naming it."""


def read_text(path: str | os.PathLike, where: str | None = None, max_bytes: int = MAX_YAML_BYTES) -> str:
    """The UTF-8 text of ``path``, refused past ``max_bytes`` or when it does not decode.

    Args:
        path: The file.
        where: How messages name it (default: the path).
        max_bytes: The size bound.

    Raises:
        DataFileError: Too large, not UTF-8, or unreadable (a directory, no permission).
    """
    path = Path(path)
    where = where or str(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise DataFileError(f"{where} is {size} bytes; lnstab reads files of at most {max_bytes} bytes")
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)  # a file growing while read is still bounded
    except OSError as exc:
        raise DataFileError(f"{where} cannot be read ({exc.strerror or type(exc).__name__})") from None
    if len(data) > max_bytes:
        raise DataFileError(f"{where} is over {max_bytes} bytes; lnstab reads files of at most {max_bytes} bytes")
    return decode(data, where)


def decode(data: bytes, where: str) -> str:
    """``data`` as strict UTF-8, or a one-line error naming the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataFileError(f"{where} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                            f"save it as UTF-8") from None


def yaml_error(where: str, exc: yaml.YAMLError) -> DataFileError:
    """A YAML syntax (or construction) error as one line with its line and column."""
    mark = getattr(exc, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
    return DataFileError(f"{where} is not valid YAML{at}: {problem}")


def check_yaml_text(text: str, where: str, *, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES,
                    strict: bool = False) -> None:
    """Refuse YAML text that nests deeper than ``max_depth`` or expands to more than ``max_nodes`` values.

    With ``strict`` a syntax error is refused too; without it, text that is not YAML passes (whoever parses it
    next reports the syntax in its own words).

    Raises:
        DataFileError: A bound is broken (or, with ``strict``, the text is not YAML).
    """
    try:
        aliases, strings = _scan_events(text, where, max_depth, max_nodes)
        if aliases:
            loader = _LOADER(text)
            try:
                nodes = []
                while loader.check_node():
                    nodes.append(loader.get_node())
            finally:
                loader.dispose()
            _count(nodes, where, max_depth, max_nodes)
    except yaml.YAMLError as exc:
        if "maximum nesting depth" in str(getattr(exc, "problem", "")):  # libyaml's own limit, met while scanning
            raise _too_deep(where, max_depth, getattr(exc, "problem_mark", None)) from None
        if strict:
            raise yaml_error(where, exc) from None
        return
    inner = where if where.endswith(_IN_STRING) else where + _IN_STRING
    for value in strings:  # YAML inside a string: shorter at each level, so this ends
        if len(value) < len(text):
            check_yaml_text(value, inner, max_depth=max_depth, max_nodes=max_nodes)


def _scan_events(text: str, where: str, max_depth: int, max_nodes: int) -> tuple[bool, list[str]]:
    """Walk the parser's events (iterative, no recursion) for the depth and, alias-free, the value count.

    Returns whether there are aliases, and the string scalars that may hold YAML with aliases themselves.
    """
    depth = values = 0
    aliases = False
    strings: list[str] = []
    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, _OPEN):
            depth += 1
            values += 1
            if depth > max_depth:
                raise _too_deep(where, max_depth, event.start_mark)
        elif isinstance(event, _CLOSE):
            depth -= 1
        elif isinstance(event, yaml.ScalarEvent):
            values += 1
            if len(event.value) > MAX_NUMBER_CHARS and not event.style and _YAML_NUMBER.fullmatch(event.value):
                raise _too_long(where, event.value, event.start_mark)
            if "&" in event.value and "*" in event.value:
                strings.append(event.value)
        elif isinstance(event, yaml.AliasEvent):
            aliases = True
        if values > max_nodes and not aliases:
            raise DataFileError(f"{where} holds more than {max_nodes} values; lnstab reads at most {max_nodes}")
    return aliases, strings


def _too_long(where: str, number: str, mark: Any = None) -> DataFileError:
    line = f" at line {mark.line + 1}" if mark is not None else ""
    return DataFileError(f"{where} holds a number of {len(number)} characters{line} ({number[:12]}…); lnstab reads "
                         f"numbers of at most {MAX_NUMBER_CHARS}")


class _TooLong(Exception):
    """A JSON number past :data:`MAX_NUMBER_CHARS`, raised from ``json``'s number hooks (caught, then named)."""


def _parse_int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise _TooLong(text)
    return int(text)


def _parse_float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise _TooLong(text)
    return float(text)


def json_loads(text: str, where: str, object_hook: Callable[[dict[str, Any]], Any] | None = None) -> Any:
    """``json.loads`` with every number bounded by :data:`MAX_NUMBER_CHARS` (a longer one is refused naming
    ``where``); ``json``'s own errors (``JSONDecodeError``, ``RecursionError``) pass through."""
    try:
        return json.loads(text, object_hook=object_hook, parse_int=_parse_int, parse_float=_parse_float)
    except _TooLong as exc:
        raise _too_long(where, str(exc)) from None


def _too_deep(where: str, max_depth: int, mark: Any = None) -> DataFileError:
    line = f" (at line {mark.line + 1})" if mark is not None else ""
    return DataFileError(f"{where} nests deeper than {max_depth} levels{line}; lnstab reads at most {max_depth}")


def _count(roots: list[yaml.Node], where: str, max_depth: int, max_nodes: int) -> None:
    """Values and depth of the documents with every alias expanded, memoised per node (one visit each)."""
    memo: dict[int, tuple[int, int]] = {}  # id(node) -> (values, collection levels) of its expansion
    active: set[int] = set()
    too_many = DataFileError(f"{where}: its aliases expand to more than {max_nodes} values; lnstab reads at most "
                             f"{max_nodes}")

    def visit(node: yaml.Node, above: int) -> tuple[int, int]:
        key = id(node)
        if key in memo:
            size, height = memo[key]
            if above + height > max_depth:
                raise _too_deep(f"{where}, its aliases expanded,", max_depth)
            return size, height
        if key in active:
            line = node.start_mark.line + 1 if node.start_mark else "?"
            raise DataFileError(f"{where}: an alias refers to the value that holds it (the value at line {line}); "
                                f"such a value has no end")
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            memo[key] = (1, 0)
            return 1, 0
        if above + 1 > max_depth:
            raise _too_deep(f"{where}, its aliases expanded,", max_depth)
        active.add(key)
        size, height = 1, 0
        for child in children:
            s, h = visit(child, above + 1)
            size, height = size + s, max(height, h)
            if size > max_nodes:
                raise too_many
        active.discard(key)
        memo[key] = (size, height + 1)
        return memo[key]

    if sum(visit(root, 0)[0] for root in roots) > max_nodes:
        raise too_many


def load_yaml_text(text: str, where: str, *, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES) -> Any:
    """One YAML document from ``text`` (``yaml.safe_load``'s result), within the bounds.

    Raises:
        DataFileError: Not valid YAML (line and column named), or past a bound.
    """
    check_yaml_text(text, where, max_depth=max_depth, max_nodes=max_nodes, strict=True)
    try:
        data = yaml.load(text, Loader=_LOADER)  # noqa: S506 - a safe loader (CSafeLoader or SafeLoader)
    except yaml.YAMLError as exc:
        raise yaml_error(where, exc) from None
    return data


def load_yaml(path: str | os.PathLike, where: str | None = None, *, max_bytes: int = MAX_YAML_BYTES) -> Any:
    """The YAML document in ``path``, read within every bound of this module.

    Args:
        path: The file.
        where: How messages name it (e.g. ``"--config a.yaml"``, ``"grid g.yaml"``; default: the path).
        max_bytes: The size bound.

    Raises:
        DataFileError: Unreadable, too large, not UTF-8, not valid YAML, too deep or expanding too far.
    """
    where = where or str(path)
    return load_yaml_text(read_text(path, where, max_bytes), where)


def load_json_text(text: str, where: str, *, max_depth: int = MAX_DEPTH,
                   object_hook: Callable[[dict[str, Any]], Any] | None = None) -> Any:
    """The JSON value in ``text``, nested at most ``max_depth`` levels.

    Raises:
        DataFileError: Not valid JSON (truncated, damaged; line and column named), or too deep.
    """
    check_json_depth(text, where, max_depth)
    try:
        return json_loads(text, where, object_hook)
    except RecursionError:
        raise _too_deep(where, max_depth) from None
    except json.JSONDecodeError as exc:
        raise DataFileError(f"{where} is not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg} "
                            f"(truncated or damaged)") from None


def check_json_depth(text: str, where: str, max_depth: int = MAX_DEPTH) -> None:
    """Refuse JSON nested deeper than ``max_depth`` (brackets outside strings), before ``json`` recurses."""
    if text.count("[") + text.count("{") <= max_depth:
        return
    depth = 0
    for token in _JSON_TOKENS.finditer(text):  # strings and brackets only: a few per series, not per number
        ch = token.group()
        if ch in "[{":
            depth += 1
            if depth > max_depth:
                raise _too_deep(where, max_depth)
        elif ch in "]}":
            depth -= 1


def load_json(path: str | os.PathLike, where: str | None = None, *, max_bytes: int = MAX_JSON_BYTES,
              object_hook: Callable[[dict[str, Any]], Any] | None = None) -> Any:
    """The JSON value in ``path``, read within the size, UTF-8 and depth bounds.

    Raises:
        DataFileError: Unreadable, too large, not UTF-8, not valid JSON or too deep.
    """
    where = where or str(path)
    return load_json_text(read_text(path, where, max_bytes), where, object_hook=object_hook)


_installed: list[Callable[..., Any]] = []


def bound_jsonargparse() -> None:
    """Put :func:`check_yaml_text` in front of jsonargparse's YAML loader (once per process).

    jsonargparse reads some files itself (``--trainer trainer.yaml``) and parses command-line values and string
    values of configs as YAML; its own loader and its syntax-error handling are kept, only the bounds are added.
    """
    if _installed:
        return
    from jsonargparse import get_loader, set_loader

    original = get_loader("yaml")

    def bounded(text: str, path: str | None = None) -> Any:  # jsonargparse passes path= where it read a file
        check_yaml_text(text, f"YAML file {path}" if path else "a YAML value given to lnstab")
        return original(text)

    set_loader("yaml", bounded, (yaml.YAMLError,))
    _installed.append(original)
