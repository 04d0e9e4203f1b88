"""``lnstab check --compare OLD NEW``: what changed between two cards, or two validation runs, made elsewhere.

Each side is a card directory (``report.json``) or a validation directory (``summary.json`` and a card per row, as
``--validate`` writes them); cards are matched by row id, criteria by id. It reads JSON only and trains nothing; its
report and exit statuses are described in docs/check/README.md.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

from lnstab.check.criteria import display
from lnstab.check.options import EXIT_FAILED  # also the status of a comparison that failed
from lnstab.check.report import ERROR, INTERRUPTED, MARK, cell, provenance
from lnstab.check.runner import public_path
from lnstab.errors import LNStabError, one_line
from lnstab.rundir import read_json
from lnstab.validation import is_number

TOLERANCES = (1e-3, 1e-2, 1e-1)  # the relative moves the measurement summary counts within
LARGEST = 10  # measurements listed by how far they moved
INPUTS = (("model", lambda c: (c.get("model") or {}).get("description")),  # what a card was made of
          ("protocol", lambda c: c.get("protocol_text")), ("data", lambda c: c.get("data_text")))


def load_cards(path: str) -> tuple[str, dict[str, dict[str, Any]]]:
    """``(kind, {row id: card})`` of a card directory (one card, id ``card``) or a validation directory."""
    where = Path(path)
    try:
        if (where / "report.json").is_file():
            return "card", {"card": _read(where / "report.json", path)}
        if (where / "summary.json").is_file():
            rows = _read(where / "summary.json", path).get("rows")
            if not isinstance(rows, dict) or not rows:
                raise LNStabError(f"--compare {path}: its summary.json lists no rows")
            odd = [r for r in rows if not r or "/" in r or "\\" in r or r in (".", "..")]
            if odd:  # a row is a directory beside summary.json, never a path elsewhere
                raise LNStabError(f"--compare {path}: its summary.json names row {odd[0]!r}, which is not a row id")
            missing = [r for r in rows if not (where / r / "report.json").is_file()]
            if missing:
                raise LNStabError(f"--compare {path}: row {missing[0]} of its summary.json has no {missing[0]}/"
                                  "report.json")
            return "validation", {r: _read(where / r / "report.json", path) for r in rows}
    except OSError as exc:
        raise LNStabError(f"--compare {path} cannot be read ({exc.strerror or type(exc).__name__})") from None
    ended = (" (a check a signal ended there, with no card: see its interrupted.txt)"
             if (where / INTERRUPTED).is_file() else
             " (a check that failed there, with no card: see its error.txt)" if (where / ERROR).is_file() else "")
    raise LNStabError(f"--compare {path} is not allowed: give a card directory (report.json) or a validation "
                      f"directory (summary.json), as lnstab check writes them{ended}")


def _read(file: Path, path: str) -> dict[str, Any]:
    """A card's or summary's JSON (:func:`~lnstab.rundir.read_json`: bounded, non-finite numbers back as floats), a
    card's fields checked (:func:`check_card`); a damaged or malformed file is a one-line error."""
    data = read_json(file)
    if not isinstance(data, dict) or file.name == "report.json" and not (isinstance(data.get("criteria"), list)
                                                                          and data["criteria"]):
        raise LNStabError(f"--compare {path}: {file.name} is not lnstab check's (no criteria)")
    if file.name == "report.json":
        check_card(data, f"--compare {path}: {file}")
    return data


NUMBER = "a number or null"
STRING = "a string or null"
SCALAR = "a string, a number or null"
# The fields of a card this comparison reads, and what each must be (a card lnstab check writes always is).
CARD_FIELDS = {"status": "a string", "model": "an object or null", "protocol_text": STRING, "data_text": STRING,
               "provenance": "an object or null"}
CRITERION_FIELDS = {"id": "a string", "status": STRING, "measured": NUMBER, "warn": NUMBER, "fail": NUMBER}
MACHINE_FIELDS = {"native_bf16": "true, false or null"}
VERDICTS = ("pass", "warn", "fail")  # a card's status, and a criterion's with n/a


def _is(value: Any, kind: str) -> bool:
    number = is_number(value)
    return {"a string": isinstance(value, str), STRING: value is None or isinstance(value, str),
            NUMBER: value is None or number, "an object or null": value is None or isinstance(value, dict),
            "true, false or null": value is None or isinstance(value, bool),
            SCALAR: value is None or isinstance(value, str) or number}[kind]


def check_card(card: dict[str, Any], where: str) -> None:
    """Refuse a card whose fields that ``--compare`` reads are of another type than lnstab check writes (a list as
    ``status``, a string as ``provenance`` or ``model``): one line naming the file, the field and its value.

    Raises:
        LNStabError: The first malformed field (``lnstab`` exits 2: a malformed card is bad input, not a changed
            verdict).
    """
    def bad(field: str, value: Any, kind: str) -> LNStabError:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        return LNStabError(f"{where} is not a card lnstab check writes: {field} is {shown}; it must be {kind}")

    for name, kind in CARD_FIELDS.items():
        if not _is(card.get(name), kind):
            raise bad(name, card.get(name), kind)
    if card["status"] not in VERDICTS:
        raise bad("status", card["status"], f"one of {', '.join(VERDICTS)}")
    seen: set[str] = set()
    for i, criterion in enumerate(card["criteria"]):
        if not isinstance(criterion, dict):
            raise bad(f"criteria[{i}]", criterion, "an object")
        for name, kind in CRITERION_FIELDS.items():
            if not _is(criterion.get(name), kind):
                raise bad(f"criteria[{i}].{name}", criterion.get(name), kind)
        if criterion.get("status") not in (None, *VERDICTS, "n/a"):
            raise bad(f"criteria[{i}].status", criterion["status"], f"one of {', '.join(VERDICTS)}, n/a or null")
        if criterion["id"] in seen:
            raise bad(f"criteria[{i}].id", criterion["id"], "an id no other criterion of the card has")
        seen.add(criterion["id"])
    provenance = card.get("provenance") or {}
    machine = provenance.get("machine")
    if machine is not None and not isinstance(machine, dict):
        raise bad("provenance.machine", machine, "an object")
    scalars = [(f"provenance.{k}", v, SCALAR) for k, v in provenance.items() if k != "machine"]
    scalars += [(f"provenance.machine.{k}", v, MACHINE_FIELDS.get(k, SCALAR)) for k, v in (machine or {}).items()]
    for name, value, kind in scalars:
        if not _is(value, kind):
            raise bad(name, value, kind)


def moved(a: Any, b: Any) -> float | None:
    """The relative move from ``a`` to ``b`` (``|a − b| / max(|a|, |b|)``); 0 when both are the same non-finite
    value or missing alike, ``inf`` when only one is finite, ``None`` when either is not a number."""
    if a is None and b is None:
        return 0.0
    if not (is_number(a) and is_number(b)):
        return None if a is not None and b is not None else math.inf
    if not (math.isfinite(a) and math.isfinite(b)):
        return 0.0 if repr(float(a)) == repr(float(b)) else math.inf
    scale = max(abs(a), abs(b))
    return 0.0 if scale == 0 else abs(a - b) / scale


def shown(cid: str, value: Any) -> str:
    """A value as the card reads it (:func:`~lnstab.check.criteria.display`; a number too large for its
    units, e.g. a growth exponent of 1e299 as a factor, as the number itself), anything else as text."""
    if not is_number(value):
        return str(value)
    try:
        return display(cid, value)
    except (OverflowError, ValueError):
        return f"{value:.4g}"


def _value(cid: str, c: dict[str, Any]) -> str:
    bands = [f"{level} {shown(cid, c.get(level))}" for level in ("warn", "fail") if c.get(level) is not None]
    return f"{MARK.get(c.get('status'), c.get('status'))} {shown(cid, c.get('measured'))}" + (
        f" ({', '.join(bands)})" if bands else "")


def main(pairs: list[str], model_args: dict[str, Any], rest: list[str]) -> None:
    """``lnstab check --compare OLD NEW`` (``pairs``): print the report; exit 1 when a verdict (or the set of cards)
    differs. ``model_args`` and ``rest`` are the other arguments given, refused: a comparison trains nothing."""
    others = [a for a in rest if a.startswith("--") and a.split("=", 1)[0] != "--compare"]
    if model_args or others:
        first = f"--model.{next(iter(model_args))}" if model_args else others[0].split("=", 1)[0]
        raise LNStabError(f"{first} is not used with --compare, which reads two finished cards and trains nothing")
    try:
        text, code = compare(*pairs)
    except LNStabError:
        raise
    except Exception as exc:  # never exit 1 ("a verdict changed") for a comparison that could not be made
        if os.environ.get("LNSTAB_DEBUG"):
            raise
        sys.stderr.write(f"lnstab: error: lnstab check --compare failed: {type(exc).__name__}: {one_line(exc)[:300]}; "
                         "nothing compared\n")
        raise SystemExit(EXIT_FAILED) from None
    sys.stdout.write(text + "\n")
    if code:
        raise SystemExit(code)


def compare(old: str, new: str) -> tuple[str, int]:
    """The Markdown report of ``old`` against ``new`` and the exit status (0: the same verdicts on the same cards)."""
    kind_a, a = load_cards(old)
    kind_b, b = load_cards(new)
    if kind_a != kind_b:
        raise LNStabError(f"--compare {old} is a {kind_a} and {new} a {kind_b}: compare a card with a card, or a "
                          "validation with a validation")
    common = [r for r in a if r in b]
    only = [f"only in {side}: {', '.join(rows)}" for side, rows in
            (("OLD", [r for r in a if r not in b]), ("NEW", [r for r in b if r not in a])) if rows]
    verdicts = [(r, a[r].get("status"), b[r].get("status")) for r in common
                if a[r].get("status") != b[r].get("status")]
    cells, moves, one_sided = [], [], []
    n_criteria = 0
    for r in common:  # check_card has made every criterion an object with a distinct string id
        by_id = {c["id"]: c for c in b[r]["criteria"]}
        ids_a = [c["id"] for c in a[r]["criteria"]]
        one_sided += [f"`{cid}` of {r} only in {side}" for side, ids in
                      (("OLD", [i for i in ids_a if i not in by_id]), ("NEW", [i for i in by_id if i not in ids_a]))
                      for cid in ids]
        for ca in a[r]["criteria"]:
            if (cb := by_id.get(ca["id"])) is None:
                continue
            n_criteria += 1
            if ca.get("status") != cb.get("status"):
                cells.append((r, ca["id"], _value(ca["id"], ca), _value(ca["id"], cb)))
            m = moved(ca.get("measured"), cb.get("measured"))
            if m is not None:
                moves.append((m, r, ca["id"], ca.get("measured"), cb.get("measured")))
    made = [f"- OLD `{public_path(old)}`: {_made(a)}", f"- NEW `{public_path(new)}`: {_made(b)}"]
    inputs = [(r, what, get(a[r]), get(b[r])) for r in common for what, get in INPUTS if get(a[r]) != get(b[r])]
    lines = [f"# `lnstab check --compare`: {len(common)} {'card' if kind_a == 'card' else 'row'}"
             f"{'s' if len(common) != 1 else ''} in common", "", *made, "",
             f"**Verdicts: {len(common) - len(verdicts)} of {len(common)} the same**"
             + (f"; {'; '.join(only)}" if only else "") + ".", ""]
    if inputs:
        lines += ["**Not the same check**: these cards were made of another model, protocol or data, so what moved is "
                  "not only the machine's:", "", "| row | what | OLD | NEW |", "|---|---|---|---|",
                  *[f"| {r} | {what} | {cell(x)} | {cell(y)} |" for r, what, x, y in inputs], ""]
    if verdicts:
        lines += ["| row | OLD | NEW |", "|---|---|---|",
                  *[f"| {r} | {MARK.get(x, x)} | {MARK.get(y, y)} |" for r, x, y in verdicts], ""]
    lines += [f"**Criterion statuses: {n_criteria - len(cells)} of {n_criteria} the same"
              + (f"**; {'; '.join(one_sided)}." if one_sided else ".**") + " A status may change "
              "because the measurement moved or because its thresholds did (most are set by the references' "
              "measurements, which move too).", ""]
    if cells:
        lines += ["| row | criterion | OLD | NEW |", "|---|---|---|---|",
                  *[f"| {r} | `{cid}` | {cell(x)} | {cell(y)} |" for r, cid, x, y in cells], ""]
    finite = [m for m in moves if math.isfinite(m[0])]
    within = ", ".join(f"{sum(m[0] <= t for m in moves)} within {t:.1%}".replace(".0%", "%") for t in TOLERANCES)
    lines += [f"**Measurements: {len(moves)} compared**: {within}"
              + (f", {len(moves) - len(finite)} finite on one side only" if len(finite) < len(moves) else "")
              + (f"; median move {sorted(m[0] for m in finite)[len(finite) // 2]:.2%}" if finite else "") + ".", ""]
    largest = sorted((m for m in moves if m[0] > 0), key=lambda m: -m[0])[:LARGEST]
    if largest:
        lines += ["Largest moves:", "", "| row | criterion | OLD | NEW | moved |", "|---|---|---|---|---|",
                  *[f"| {r} | `{cid}` | {shown(cid, x)} | {shown(cid, y)} | "
                    f"{'one side not finite' if not math.isfinite(m) else f'{m:.1%}'} |"
                    for m, r, cid, x, y in largest], ""]
    return "\n".join(lines), int(bool(verdicts or only or one_sided))


def _made(cards: dict[str, dict[str, Any]]) -> str:
    where = {provenance(c["provenance"]) if c.get("provenance") else "provenance not recorded"
             for c in cards.values()}
    return "; ".join(sorted(where))
