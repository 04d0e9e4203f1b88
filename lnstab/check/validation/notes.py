"""The validation READMEs' notes (``notes.yaml``) and change records (``changes.yaml``), and :func:`render`, which
fills a note's placeholders from the cards of its run (their forms: ``notes.yaml``'s header)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from lnstab.check.criteria import BY_ID, display
from lnstab.formatting import card_quote
from lnstab.safeload import DataFileError, load_yaml

HERE = Path(__file__).parent


def _texts(data: Any, file: str, key: str, kind: type) -> Any:
    """``data[key]``: a mapping of ids to notes (``kind`` dict) or a list of records (``kind`` list), all strings."""
    value = data.get(key) if isinstance(data, dict) else None
    items = value.values() if isinstance(value, dict) else value
    if not isinstance(value, kind) or not all(isinstance(v, str) and v.strip() for v in items):
        shape = "a mapping of ids to strings" if kind is dict else "a list of strings"
        raise DataFileError(f"{file}: {key} is {value!r}; {shape} is allowed")
    return value


_notes = load_yaml(HERE / "notes.yaml", "notes.yaml")
_changes = load_yaml(HERE / "changes.yaml", "changes.yaml")
NOTES: dict[str, str] = _texts(_notes, "notes.yaml", "rows", dict)  # the main set's, by row id
HELDOUT_NOTES: dict[str, str] = _texts(_notes, "notes.yaml", "heldout", dict)  # the held-out set's, by row id
SUPPLEMENT_NOTES: dict[str, str] = _texts(_notes, "notes.yaml", "supplements", dict)  # by supplement id
THRESHOLD_CHANGES: list[str] = _texts(_changes, "changes.yaml", "thresholds", list)
ROW_CHANGES: list[str] = _texts(_changes, "changes.yaml", "rows", list)

PLACEHOLDER = re.compile(r"\{([^{}]+)\}")
_CRITERION = re.compile(r"(?P<row>[\w.-]+?)\.(?P<cid>[a-z_]+)(?:@(?P<ref>[\w-]+)|#(?P<level>warn|fail))?")
_PATH = re.compile(r"(?P<row>[\w.-]+):(?P<path>[^|]+)(?:\|(?P<fmt>.+))?")
_RATIO = re.compile(r"(?P<a>[^/|:]+)(?:/(?P<b>[^/|:]+))?\|(?P<fmt>decades|times)")


class NoteError(ValueError):
    """A placeholder of a note that the run's cards cannot fill."""


def _criterion(match: re.Match[str], cards: dict[str, dict[str, Any]]) -> float | None:
    """The value a ``row.criterion[@reference|#level]`` placeholder names, in the card's units."""
    card = _card(match["row"], cards)
    found = [c for c in card["criteria"] if c["id"] == match["cid"]]
    if not found:
        raise NoteError(f"no criterion {match['cid']!r} on the card of {match['row']}")
    item = found[0]
    if match["ref"]:
        if match["ref"] not in item["references"]:
            raise NoteError(f"no reference {match['ref']!r} (have: {', '.join(item['references'])})")
        return item["references"][match["ref"]]
    return item[match["level"]] if match["level"] else item["measured"]


def _card(row: str, cards: dict[str, dict[str, Any]]) -> dict[str, Any]:
    card = cards.get(row)
    if card is None:
        raise NoteError(f"no card for row {row!r} (have: {', '.join(cards)})")
    return card


def _operand(text: str, cards: dict[str, dict[str, Any]]) -> float:
    """A ratio's operand: a criterion placeholder's value as the card reads it (a factor for spreads and growth),
    or a number (``65504``)."""
    match = _CRITERION.fullmatch(text.strip())
    if match is None:
        try:
            return float(text)
        except ValueError:
            raise NoteError(f"{text.strip()!r} is neither row.criterion[@reference|#warn|#fail] nor a number") from None
    value = _criterion(match, cards)
    if value is None or not math.isfinite(value):
        raise NoteError(f"{text.strip()} is not a finite number")
    return BY_ID[match["cid"]].as_factor(value) if match["cid"] in BY_ID else value


def _ratio(match: re.Match[str], cards: dict[str, dict[str, Any]]) -> str:
    """``a/b|times`` (the ratio, as :func:`number` quotes it) or ``a/b|decades``, ``a|decades`` (its log10, to the
    nearest whole decade)."""
    below = _operand(match["b"], cards) if match["b"] else 1.0
    if below == 0:
        raise NoteError(f"{match[0]} divides by 0")
    value = _operand(match["a"], cards) / below
    if match["fmt"] == "times":
        return card_quote(value)
    if value <= 0:
        raise NoteError(f"{match[0]} has no decades: the ratio is {value}")
    return f"{math.log10(value):.0f}"


def _fill(text: str, cards: dict[str, dict[str, Any]]) -> str:
    ratio = _RATIO.fullmatch(text)
    if ratio:
        return _ratio(ratio, cards)
    criterion = _CRITERION.fullmatch(text) if ":" not in text else None
    match = criterion or _PATH.fullmatch(text)
    if not match:
        raise NoteError("neither row.criterion[@reference|#warn|#fail], row:path[|format] nor a[/b]|decades|times")
    if criterion:
        return display(match["cid"], _criterion(criterion, cards))
    card = _card(match["row"], cards)
    value: Any = card
    for key in match["path"].split("/"):
        try:
            # a card in memory keys its ladder by float (0.001), its report.json by string: match by the string
            value = value[int(key)] if isinstance(value, list) else next(v for k, v in value.items() if str(k) == key)
        except (StopIteration, IndexError, ValueError, TypeError, AttributeError):
            raise NoteError(f"the card of {match['row']} has no {match['path']!r} (at {key!r})") from None
    if match["fmt"]:
        return format(value, match["fmt"])
    return card_quote(value) if isinstance(value, float) else str(value)


def render(note: str, cards: dict[str, dict[str, Any]]) -> str:
    """``note`` with every placeholder filled from ``cards`` (row id → card, as ``report.json`` holds it).

    Raises:
        NoteError: A placeholder names a row, criterion, reference or key the cards do not have; the message quotes
            the placeholder.
    """

    def fill(match: re.Match[str]) -> str:
        try:
            return _fill(match[1], cards)
        except NoteError as exc:
            raise NoteError(f"note placeholder {match[0]}: {exc}") from None

    return PLACEHOLDER.sub(fill, note)
