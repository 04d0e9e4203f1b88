"""The validation READMEs, rendered from one run record: the ``summary.json`` that ``lnstab check --validate`` writes
(its ``readme`` key holds what the cards do not: the command, the run counts, the shape and data flags, whether the
notes apply, the thresholds' ``git log`` at the time) and the cards of its rows. The page is ``readme.md``, its parts
``sections.md`` (``string.Template``); the main README also reports the held-out set and the supplements found
beside it. Everything here reads; nothing trains.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from string import Template
from typing import Any

from lnstab.check.criteria import CRITERIA
from lnstab.check.protocol import tiers
from lnstab.check.report import MARK as SHORT  # a status as the README tables show it
from lnstab.check.report import provenance as made_by
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
from lnstab.formatting import cell
from lnstab.rundir import read_json

HERE = Path(__file__).parent
HELDOUT_DIR = "heldout"  # the held-out set's directory under the main set's
SETS = {"main": ROWS, "heldout": HELDOUT}  # --set: the validation set, the held-out set (its own README)
DEFAULT_TIER = "quick"  # a run record without a tier (before issue 39) ran at the quick tier's protocol
# What "fixed before the run" is checked by: the thresholds and the rows with their expected verdicts.
HISTORY_PATHS = ("lnstab/check/criteria.py", "lnstab/check/thresholds.yaml", "lnstab/check/thresholds-proxy.yaml",
                 "lnstab/check/tiers.yaml", "lnstab/check/validation.py",
                 "lnstab/check/validation/rows.yaml", "lnstab/check/validation/heldout.yaml",
                 "lnstab/check/validation/supplements.yaml")
_MARKER = re.compile(r"^<!-- ([a-z][a-z-]*)(?:: [^>]*)? -->$", re.MULTILINE)


def _templates() -> tuple[Template, dict[str, Template]]:
    """``readme.md`` and the parts of ``sections.md`` by name (each the text between its marker and the next, less
    the newlines it ends with)."""
    text = (HERE / "sections.md").read_text(encoding="utf-8")
    marks = list(_MARKER.finditer(text))
    parts = {m[1]: Template(text[m.end() + 1:(marks[i + 1].start() if i + 1 < len(marks) else len(text))].rstrip("\n"))
             for i, m in enumerate(marks)}
    return Template((HERE / "readme.md").read_text(encoding="utf-8")), parts


PAGE, PARTS = _templates()


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


def verdict_list(summary: dict[str, Any]) -> str:
    """``post-ln FAIL, deepnorm FAIL (disagrees)``: each row of a run's ``summary.json`` with its card's verdict."""
    return ", ".join(f"{row} {SHORT[v['card']]}" + ("" if v["card"] in v["expected"] else " (disagrees)")
                     for row, v in summary["rows"].items())


def verdicts(row: Row) -> str:
    return " or ".join(SHORT[e] for e in row.expected)


def supplement_section(results: dict[str, dict[str, Any] | None], data_arg: str) -> str:
    """The main README's section on the supplements: question, prediction, command and what came out."""
    items = []
    for sup in SUPPLEMENTS:
        got = results.get(sup.id)
        expected = "".join(PARTS["supplement-expected"].substitute(
            id=row.id, design=row.design, verdicts=verdicts(row), outcome=row.outcome, source=row.source)
            for row in sup.rows)
        result = "not run yet" if got is None else PARTS["supplement-result"].substitute(
            agree=got["agree"], n_rows=len(got["rows"]), id=sup.id, minutes=f"{got['wall_s'] / 60:.1f}",
            verdicts=verdict_list(got))
        note = SUPPLEMENT_NOTES.get(sup.id)
        note = " " + note_text(note, got["cards"]) if note and got is not None and got.get("cards") else ""
        items.append(PARTS["supplement-item"].substitute(
            id=sup.id, data=data_arg, args=" ".join(sup.args), question=sup.question, expected=expected,
            prediction=sup.prediction, result=result, note=note))
    return PARTS["supplements"].substitute(items="\n".join(items))


def percent(value: float) -> str:
    return f"{100 * value:.0f}"


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
    got = score(rows, cards, tier)
    left = ", ".join(f"{r.id} ({why})" for r, why in got.left_out) or "none"
    unrun = [r.id for r in SETS[summary["set"]] if r.id not in summary["rows"]]
    unrun_text = "" if not unrun or "--rows" in summary.get("args", []) else PARTS["reach-unrun"].substitute(
        rows=", ".join(unrun))
    if not got.scored:
        return PARTS["reach-none"].substitute(tier=tier, left_out=left, unrun=unrun_text) + "\n\n"
    n, (constant, constant_agree) = len(got.scored), got.baseline
    low, high = got.interval
    return PARTS["reach-headline"].substitute(
        tier=tier, agree=got.agree, n=n, percent=percent(got.agree / n), low=percent(low), high=percent(high),
        constant=SHORT[constant], constant_agree=constant_agree, margin=margin(got.agree - constant_agree),
        left_out=left, unrun=unrun_text) + "\n\n"


def margin(more: int) -> str:
    """How many more rows the check agrees on than the constant verdict: ``2 more``, ``as many``, ``1 fewer``."""
    return f"{more} more" if more > 0 else "as many" if more == 0 else f"{-more} fewer"


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
    result = "not run yet." if got is None else PARTS["heldout-result"].substitute(
        agree=got["agree"], n_rows=len(got["rows"]), dir=HELDOUT_DIR, minutes=f"{got['wall_s'] / 60:.1f}",
        verdicts=verdict_list(got), baseline=constant_text([r for r in HELDOUT if r.id in got["rows"]]),
        stable=sum(r.expected == STABLE for r in HELDOUT), n_all=len(HELDOUT),
        reach=reach_headline(got, record_rows(got), [v["card"] for v in got["rows"].values()]).strip()
        .replace("**", ""))
    return PARTS["heldout"].substitute(n_rows=len(HELDOUT), prediction=HELDOUT_PREDICTION, result=result)


def constant_text(rows: list[Row]) -> str:
    """What a card that always gives one verdict would score on ``rows``: the baseline the check's agreement is to be
    read against (most published outcomes are "stable", which any verdict but FAIL matches)."""
    (best, agree), counts = best_constant(rows), constant_counts(rows)
    others = ", ".join(f"always {SHORT[v]} {n}" for v, n in counts.items() if v != best)
    return (f"Baseline: a card that always said {SHORT[best]}, whatever the model, would agree on {agree} of "
            f"{len(rows)} rows ({others}); the check's worth is in the rows a constant verdict gets wrong.")


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
    rec, set_name = summary["readme"], summary["set"]
    rows = record_rows(summary)
    sup = SUPPLEMENT_IDS.get(summary.get("supplement", ""))
    tier = run_tier(summary)
    notes, heldout = rec["notes"], set_name == "heldout"
    graded = (cards[0].get("tier") or {}).get("name", DEFAULT_TIER) if cards else DEFAULT_TIER
    other_tier = graded != DEFAULT_TIER  # the cards were made at that tier's shape, with its thresholds
    agree = [c["status"] in r.expected for r, c in zip(rows, cards, strict=True)]
    by_row = {r.id: c for r, c in zip(rows, cards, strict=True)}  # what the row notes quote
    strict = sum(a for a, r in zip(agree, rows, strict=True) if len(r.expected) == 1)
    single = sum(len(r.expected) == 1 for r in rows)
    row_notes = HELDOUT_NOTES if heldout else NOTES
    preamble = ""
    if heldout:
        preamble += PARTS["heldout-preamble"].substitute(prediction=HELDOUT_PREDICTION) + "\n\n"
    if sup is not None:
        preamble += PARTS["supplement-preamble"].substitute(id=sup.id, question=sup.question,
                                                            prediction=sup.prediction) + "\n\n"
    table = []
    for i, (row, card, ok) in enumerate(zip(rows, cards, agree, strict=True), 1):
        decided = ", ".join(f"`{c}`" for c in deciding(card)) or "every criterion passes"
        note = note_text(row_notes.get(row.id, ""), by_row) if notes else ""
        why = decided + (f"; {note}" if note else "" if ok or not notes else "; not yet explained")
        table.append(f"| {i} | [{cell(row.design)}]({row.id}/report.md) | {cell(row.outcome)} ({cell(row.source)}) | "
                     f"{verdicts(row)} | {cell(reached(row, tier))} | **{SHORT[card['status']]}** | "
                     f"{'yes' if ok else '**no**'} | {cell(why)} |")
    decides = []
    for c in CRITERIA:
        found = {level: [r.id for r, k in zip(rows, cards, strict=True)
                         if k["status"] == level and statuses(k)[c.id] == level] for level in ("fail", "warn")}
        decides.append(f"- `{c.id}`: fails {', '.join(found['fail']) or 'no row'}; is among the warnings of "
                       f"{', '.join(found['warn']) or 'no row'}")
    sections = PARTS["row-changes"].substitute(changes="; ".join(ROW_CHANGES)) if ROW_CHANGES else ""
    if notes and set_name == "main":
        sections += heldout_section(heldout_result(out / HELDOUT_DIR))
        sections += supplement_section(supplement_results(out), rec["data"])
    shape = rec["shape"]
    return PAGE.substitute(
        title=": the held-out set" if heldout else "", command=rec["command"],
        minutes=f"{summary['wall_s'] / 60:.1f}", runs=rec["runs"], models=rec["models"],
        made_by=made_by(cards[0]["provenance"]),
        shape=(f"the {graded} tier's shape" if other_tier else "the check's default shape")
        + ("" if not shape else " but " + ", ".join(f"`--model.{k} {v}`" for k, v in shape.items())),
        reference=reference_text(cards), protocol=cards[0]["protocol_text"], data=cards[0]["data_text"],
        preamble=preamble, headline=reach_headline(summary, rows, [c["status"] for c in cards]), agree=sum(agree),
        n_rows=len(rows), percent=percent(sum(agree) / max(1, len(rows))),
        goal="; out of sample" if heldout else "; goal ≥ 90 %", strict=strict, single=single,
        stable_agree=sum(agree) - strict, stable=len(rows) - single,
        thresholds="**a --thresholds file, not the defaults**." if not rec["default_thresholds"] else
        PARTS["thresholds-tier"].substitute(tier=graded, file=tiers()[graded]["thresholds"]) if other_tier else
        "the defaults of `lnstab/check/thresholds.yaml`, fixed before the set was first run"
        + (f"; {len(THRESHOLD_CHANGES)} changed after that run, every verdict re-run or re-graded (see Thresholds)."
           if THRESHOLD_CHANGES else " (history below)."),
        baseline=constant_text(rows), table="\n".join(table),
        criteria=" | ".join(c.id for c in CRITERIA), rule="---|" * len(CRITERIA),
        criteria_table="\n".join(f"| {row.id} | " + " | ".join(SHORT[statuses(card)[c.id]] for c in CRITERIA) + " |"
                                 for row, card in zip(rows, cards, strict=True)),
        decides="\n".join(decides),
        history="\n".join([f"- `{h}`" for h in rec["history"]] or ["- (not a git checkout)"]),
        changes=PARTS["tier-changes"].substitute(tier=graded, quick="../../" if heldout else "../") if other_tier else
        "; ".join(THRESHOLD_CHANGES) if THRESHOLD_CHANGES else
        "none; every verdict above is from the thresholds fixed before it.",
        sections=sections)


def rerender(where: Path) -> str:
    """The README of the validation in ``where``, rendered again from its committed record and cards."""
    summary = read_json(where / "summary.json")
    return readme(summary, [read_json(where / row / "report.json") for row in summary["rows"]], where)
