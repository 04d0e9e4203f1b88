"""The validation READMEs, rendered from one run record: the ``summary.json`` that ``lnstab check --validate`` writes
(its ``readme`` key holds what the cards do not: the command, the run counts, the shape and data flags, whether the
notes apply, the thresholds' ``git log`` at the time) and the cards of its rows. The page is the Jinja template
``readme.md``, its parts the macros of ``sections.md``; the main README also reports the held-out set and the
supplements found beside it. Everything here reads; nothing trains.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from lnstab.check.criteria import CRITERIA
from lnstab.check.protocol import tiers
from lnstab.check.report import TEMPLATES
from lnstab.check.validation.notes import (
    HELDOUT_NOTES,
    NOTES,
    ROW_CHANGES,
    SUPPLEMENT_NOTES,
    THRESHOLD_CHANGES,
    NoteError,
    render,
)
from lnstab.check.validation.score import best_constant, constant_counts, score
from lnstab.check.validation.sets import HELDOUT, HELDOUT_PREDICTION, ROWS, STABLE, SUPPLEMENT_IDS, SUPPLEMENTS, Row
from lnstab.check.validation.sets import supplement_rows as with_supplement
from lnstab.rundir import read_json

HELDOUT_DIR = "heldout"  # the held-out set's directory under the main set's
SETS = {"main": ROWS, "heldout": HELDOUT}  # --set: the validation set, the held-out set (its own README)
DEFAULT_TIER = "quick"  # a run record without a tier (before issue 39) ran at the quick tier's protocol
# What "fixed before the run" is checked by: the thresholds and the rows with their expected verdicts.
HISTORY_PATHS = ("lnstab/check/criteria.py", "lnstab/check/thresholds.yaml", "lnstab/check/thresholds-proxy.yaml",
                 "lnstab/check/tiers.yaml", "lnstab/check/validation.py",
                 "lnstab/check/validation/rows.yaml", "lnstab/check/validation/heldout.yaml",
                 "lnstab/check/validation/supplements.yaml")
PAGE = TEMPLATES.get_template("validation/readme.md")
SECTIONS = TEMPLATES.get_template("validation/sections.md").module


def reference_text(cards: list[dict[str, Any]]) -> str:
    """The first card's Pre-LN reference, described."""
    ref = cards[0]["references"].get("pre-ln", {}) if cards else {}
    return ref.get("description", "").split(" (the checked")[0]


def statuses(card: dict[str, Any]) -> dict[str, str]:
    return {r["id"]: r["status"] for r in card["criteria"]}


def deciding(card: dict[str, Any]) -> list[str]:
    """The criteria whose status is the card's verdict (for a warning or a failure)."""
    if card["status"] == "pass":
        return []
    return [r["id"] for r in card["criteria"] if r["status"] == card["status"]]


def history() -> list[str]:
    """``git log`` of the thresholds and the expected verdicts (oldest first), when this is a git checkout: taken
    when a validation runs and kept in its record."""
    root = Path(__file__).resolve().parents[3]
    try:
        done = subprocess.run(["git", "log", "--reverse", "--format=%h %ad %s", "--date=short", "--",
                               *HISTORY_PATHS], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line[:160] for line in done.stdout.splitlines()] if done.returncode == 0 else []


def note_text(note: str, cards: dict[str, dict[str, Any]]) -> str:
    """A note rendered from the run's cards; a placeholder they cannot fill is said in its place, so the README of
    a run of minutes is still written (the committed notes are tested against the committed cards)."""
    try:
        return render(note, cards)
    except NoteError as exc:
        return f"(note not rendered: {exc})"


def supplement_results(out: Path) -> dict[str, dict[str, Any] | None]:
    """Each supplement's ``summary.json`` under ``<out>/supplements/<id>/`` (``None`` where it has not been run or
    its summary does not read back), with its rows' cards under ``"cards"`` (row id → ``report.json``; ``None``
    unless every row's reads back), which its note quotes."""
    found: dict[str, dict[str, Any] | None] = {}
    for sup in SUPPLEMENTS:
        where = out / "supplements" / sup.id
        try:
            found[sup.id] = json.loads((where / "summary.json").read_text(encoding="utf-8"))
            cards = {row: read_json(where / row / "report.json") for row in found[sup.id]["rows"]}
        except (OSError, ValueError, KeyError, TypeError):  # a damaged file (lnstab's file errors are ValueErrors)
            found[sup.id] = None
            continue
        found[sup.id]["cards"] = cards if all(isinstance(c, dict) for c in cards.values()) else None
    return found


def heldout_result(where: Path) -> dict[str, Any] | None:
    """The held-out set's ``summary.json`` under ``where`` (``None`` where it has not been run or does not read back
    as one)."""
    try:
        found = json.loads((where / "summary.json").read_text(encoding="utf-8"))
        return found if found.get("set") == "heldout" and isinstance(found.get("rows"), dict) else None
    except (OSError, ValueError, AttributeError):
        return None


def supplement_section(results: dict[str, dict[str, Any] | None], data_arg: str) -> str:
    """The main README's section on the supplements: question, prediction, command and what came out."""
    items = []
    for sup in SUPPLEMENTS:
        got, note = results.get(sup.id), SUPPLEMENT_NOTES.get(sup.id)
        items.append((sup, got, note_text(note, got["cards"]) if note and got is not None and got.get("cards") else ""))
    return SECTIONS.supplements(items, data_arg)


def run_tier(summary: dict[str, Any]) -> str | None:
    """The tier a run of a set was made at: its record's ``tier``; for a record made before tiers (issue 39), the
    quick tier where it ran the whole set at the default shape and protocol (its ``notes``); ``None`` for a
    supplement or another shape, whose protocol is no tier."""
    if "tier" in summary:
        return summary["tier"]
    return DEFAULT_TIER if not summary.get("supplement") and summary.get("readme", {}).get("notes") else None


def reach_headline(summary: dict[str, Any], rows: list[Row], cards: list[str]) -> str:
    """The headline of a run at its tier (issue 39): its :func:`score` (``cards``: the rows' verdicts), the rows left
    out, and the set's rows the run did not have (added after it); ``""`` for a run at no tier (:func:`run_tier`)."""
    tier = run_tier(summary)
    if tier is None:
        return ""
    unrun = [] if "--rows" in summary.get("args", []) else [
        r.id for r in SETS[summary["set"]] if r.id not in summary["rows"]]
    return SECTIONS.reach(score(rows, cards, tier), unrun)


def reached(row: Row, tier: str | None) -> str:
    """A row's cell in the table's *reached* column: ``yes``, or what keeps it out of the headline and why."""
    if tier is None or row.reported is None:
        return "—"
    if row.scored(tier):
        return "yes"
    why = ("**no**" if tier not in row.reachable else "yes") + ("" if row.reported else ", implied")
    return f"{why}: {row.reach_note}"


def heldout_section(got: dict[str, Any] | None) -> str:
    """The main README's section on the held-out set: what it is, what was predicted, what came out."""
    if got is None:  # the macro's other arguments are for a result
        return SECTIONS.heldout(len(HELDOUT), HELDOUT_PREDICTION, None)
    reach = reach_headline(got, record_rows(got), [v["card"] for v in got["rows"].values()]).replace("**", "")
    return SECTIONS.heldout(len(HELDOUT), HELDOUT_PREDICTION, got, HELDOUT_DIR, reach,
                            constant_text([r for r in HELDOUT if r.id in got["rows"]]),
                            sum(r.expected == STABLE for r in HELDOUT))


def constant_text(rows: list[Row]) -> str:
    """What a card that always gives one verdict would score on ``rows``: the baseline the check's agreement is to be
    read against (most published outcomes are "stable", which any verdict but FAIL matches)."""
    return SECTIONS.baseline(*best_constant(rows), len(rows), constant_counts(rows))


def record_rows(summary: dict[str, Any]) -> list[Row]:
    """The rows a run record names, in its order, with its supplement's outcomes applied."""
    every = {r.id: r for r in with_supplement(SUPPLEMENT_IDS.get(summary.get("supplement", "")), SETS[summary["set"]])}
    return [every[row] for row in summary["rows"]]


def readme(summary: dict[str, Any], cards: list[dict[str, Any]], out: Path) -> str:
    """The validation README of run record ``summary`` (``summary.json``) from the ``cards`` of its rows, in its
    order: agreement, one row per architecture, which criteria decide which rows, thresholds; the row notes only for
    the whole set at the default shape and protocol (the record's ``notes``: they explain that run's numbers; another
    run's disagreements are in the main README's supplement notes); for the main set also the held-out set and the
    supplements found under ``out``, the validation's directory."""
    rec, heldout = summary["readme"], summary["set"] == "heldout"
    rows = record_rows(summary)
    tier = run_tier(summary)
    graded = (cards[0].get("tier") or {}).get("name", DEFAULT_TIER) if cards else DEFAULT_TIER
    other_tier = graded != DEFAULT_TIER  # the cards were made at that tier's shape, with its thresholds
    by_row = {r.id: c for r, c in zip(rows, cards, strict=True)}  # what the row notes quote
    row_notes = HELDOUT_NOTES if heldout else NOTES
    table = []
    for row, card in zip(rows, cards, strict=True):
        ok = card["status"] in row.expected
        decided = ", ".join(f"`{c}`" for c in deciding(card)) or "every criterion passes"
        note = note_text(row_notes.get(row.id, ""), by_row) if rec["notes"] else ""
        why = decided + (f"; {note}" if note else "" if ok or not rec["notes"] else "; not yet explained")
        table.append({"row": row, "card": card, "ok": ok, "reached": reached(row, tier), "why": why,
                      "statuses": statuses(card)})
    decides = {c.id: {level: [r["row"].id for r in table if r["card"]["status"] == level
                              and r["statuses"][c.id] == level] for level in ("fail", "warn")}
               for c in CRITERIA}
    sections = None
    if rec["notes"] and summary["set"] == "main":
        sections = {"heldout": heldout_section(heldout_result(out / HELDOUT_DIR)),
                    "supplements": supplement_section(supplement_results(out), rec["data"])}
    single = [r for r in table if len(r["row"].expected) == 1]  # the rows whose outcome implies one verdict
    return PAGE.render(
        summary=summary, rec=rec, card=cards[0], reference=reference_text(cards), heldout=heldout,
        heldout_prediction=HELDOUT_PREDICTION, sup=SUPPLEMENT_IDS.get(summary.get("supplement", "")), graded=graded,
        other_tier=other_tier, tiers=tiers(), threshold_changes=THRESHOLD_CHANGES, row_changes=ROW_CHANGES,
        headline=reach_headline(summary, rows, [c["status"] for c in cards]), table=table,
        agree=sum(r["ok"] for r in table), strict=sum(r["ok"] for r in single), single=len(single),
        baseline=constant_text(rows), criteria=CRITERIA, decides=decides, sections=sections)


def rerender(where: Path) -> str:
    """The README of the validation in ``where``, rendered again from its committed record and cards."""
    summary = read_json(where / "summary.json")
    return readme(summary, [read_json(where / row / "report.json") for row in summary["rows"]], where)
