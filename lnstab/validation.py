"""Argument checks shared by every lnstab component: one message format, one error type.

Each check returns the (normalised) value or raises :class:`lnstab.errors.ConfigError` — an
:class:`~lnstab.errors.LNStabError`, hence also a ``ValueError`` — with one line naming the field, the value and what
is allowed::

    n_samples=0 is not allowed; it must be an integer >= 1

The CLI prints any ``LNStabError`` as that one line (exit status 2), and code outside lnstab that catches
``ValueError`` keeps working. ``error`` selects a subclass (e.g. ``DataError``) where a component has its own.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from lnstab.errors import ConfigError, LNStabError


def is_number(value: Any) -> bool:
    """Whether ``value`` is an ``int`` or a ``float`` and not a ``bool`` (finite or not)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_integer(value: Any) -> bool:
    """Whether ``value`` is an ``int`` and not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(field: str, value: Any, allowed: str, error: type[LNStabError]) -> LNStabError:
    return error(f"{field}={value!r} is not allowed; {allowed}")


def integer(field: str, value: Any, minimum: int | None = None, *, error: type[LNStabError] = ConfigError) -> int:
    """``value`` as an ``int`` (bools refused) that is ``>= minimum`` when given."""
    if not is_integer(value) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise _fail(field, value, f"it must be an integer{bound}", error)
    return value


def positive_int(field: str, value: Any, *, error: type[LNStabError] = ConfigError) -> int:
    """``value`` as an ``int >= 1``."""
    return integer(field, value, 1, error=error)


def number(
    field: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    error: type[LNStabError] = ConfigError,
) -> float:
    """``value`` as a finite ``float`` in the interval given by ``low``/``high`` (open ends with ``*_open``)."""
    ok = is_number(value) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        if low is not None and high is not None:
            span = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
            allowed = f"it must be a number in {span}"
        elif low is not None:
            allowed = f"it must be a finite number {'>' if low_open else '>='} {low:g}"
        elif high is not None:
            allowed = f"it must be a finite number {'<' if high_open else '<='} {high:g}"
        else:
            allowed = "it must be a finite number"
        raise _fail(field, value, allowed, error)
    return float(value)


def optional_number(field: str, value: Any, low: float | None = None, *, low_open: bool = False,
                    error: type[LNStabError] = ConfigError) -> float | None:
    """``None``, or :func:`number` with a lower bound."""
    if value is None:
        return None
    try:
        return number(field, value, low, low_open=low_open, error=error)
    except LNStabError:
        bound = "" if low is None else f" {'>' if low_open else '>='} {low:g}"
        raise _fail(field, value, f"it must be a finite number{bound} or None", error) from None


def choice(field: str, value: Any, allowed: Sequence[Any], *, error: type[LNStabError] = ConfigError) -> Any:
    """``value`` if it is one of ``allowed``."""
    if value not in allowed:
        raise _fail(field, value, f"choose one of: {', '.join(map(str, allowed))}", error)
    return value


def flag(field: str, value: Any, *, error: type[LNStabError] = ConfigError) -> bool:
    """``value`` as a ``bool``: ``True`` or ``False`` (``"no"`` is refused, not read as true)."""
    return bool(choice(field, value, (True, False), error=error))


def choices(field: str, values: Any, allowed: Sequence[Any], *, error: type[LNStabError] = ConfigError) -> tuple:
    """A single allowed value or a list of them, as a tuple."""
    items = [values] if isinstance(values, str) else list(values) if isinstance(values, list | tuple) else None
    if items is None:
        raise _fail(field, values, f"give one or a list of: {', '.join(map(str, allowed))}", error)
    for item in items:
        if item not in allowed:
            raise _fail(field, values, f"each must be one of: {', '.join(map(str, allowed))}", error)
    return tuple(items)


def regex(field: str, value: Any, *, optional: bool = True, groups: int = 0,
          error: type[LNStabError] = ConfigError) -> re.Pattern | None:
    """``value`` compiled (``None`` passes when ``optional``); ``groups``: capture groups it must have at least."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise _fail(field, value, "it must be a regular expression string", error)
    try:
        pattern = re.compile(value)
    except re.error as err:
        raise _fail(field, value, f"it is not a valid regular expression ({err})", error) from None
    if pattern.groups < groups:
        raise _fail(field, value, f"it needs at least {groups} capture group(s)", error)
    return pattern


def file_name(field: str, value: Any, *, optional: bool = True, error: type[LNStabError] = ConfigError) -> str | None:
    """A plain file name (no directory part), or ``None`` when ``optional``."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value or "/" in value or value in (".", ".."):
        raise _fail(field, value, "give a plain file name" + (" or None" if optional else ""), error)
    return value


METRIC_PREFIX = re.compile(r"[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*")


def metric_prefix(field: str, value: Any, *, error: type[LNStabError] = ConfigError) -> str | None:
    """``None``, or a prefix for logged metric names: parts of letters, digits, ``_``, ``.``, ``-`` joined by ``/``."""
    if value is None:
        return None
    if not isinstance(value, str) or not METRIC_PREFIX.fullmatch(value):
        raise _fail(field, value, "give None or a name of letters, digits, '_', '.' and '-' (parts joined by '/', "
                    "e.g. 'mlp' or 'probe/mlp')", error)
    return value
