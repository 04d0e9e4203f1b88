"""The validation READMEs that ``lnstab check --validate`` writes (:mod:`lnstab.check.validate` runs the cards):
``docs/check/validation/README.md`` for the main set, with its row notes, the held-out set's section and the
supplements found beside it, and ``heldout/README.md`` for the held-out set. Everything here reads cards and
``summary.json`` files; nothing trains.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from lnstab.check.criteria import CRITERIA, DEFAULT_THRESHOLDS, load_thresholds
from lnstab.check.report import MARK as SHORT  # a status as the README tables show it
from lnstab.check.validation import HELDOUT, HELDOUT_PREDICTION, STABLE, SUPPLEMENTS, Row, Supplement
from lnstab.check.validation_notes import (
    HELDOUT_NOTES,
    NOTES,
    ROW_CHANGES,
    SUPPLEMENT_NOTES,
    THRESHOLD_CHANGES,
    NoteError,
    render,
)
from lnstab.rundir import read_json

HELDOUT_DIR = "heldout"  # the held-out set's directory under the main set's




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
    """``git log`` of the thresholds and the expected verdicts (oldest first), when this is a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(["git", "log", "--reverse", "--format=%h %ad %s", "--date=short", "--",
                               "lnstab/check/criteria.py", "lnstab/check/validation.py"], cwd=root,
                              capture_output=True, text=True, timeout=10)
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


def verdict_list(summary: dict[str, Any]) -> str:
    """``post-ln FAIL, deepnorm FAIL (disagrees)``: each row of a run's ``summary.json`` with its card's verdict."""
    return ", ".join(f"{row} {SHORT[v['card']]}" + ("" if v["card"] in v["expected"] else " (disagrees)")
                     for row, v in summary["rows"].items())


def supplement_lines(results: dict[str, dict[str, Any] | None], data_arg: str) -> list[str]:
    """The main README's section on the supplements: question, prediction, command and what came out."""
    lines = ["", "## Supplements", "",
             "Re-runs under other arguments, each with its question and prediction committed before it first ran "
             "(`lnstab/check/validation.py`, `SUPPLEMENTS`; `lnstab check --validate --supplement ID` runs one). The "
             "expected verdicts are the rows' own, but where a supplement's protocol is one under which the "
             "literature reports another outcome: then the supplement says so, with its source. Each supplement's "
             "own README is a record of its run, and those run before the citations were re-read (2026-12-03, see "
             "Thresholds) quote the rows' citations as they stood then.", ""]
    for sup in SUPPLEMENTS:
        got = results.get(sup.id)
        command = (f"`{' '.join(['lnstab check --validate', data_arg, '--supplement', sup.id, '--no-progress'])}`, "
                   f"its arguments `{' '.join(sup.args)}`")
        expected = "".join(f" Expected here for {row.id} ({row.design}): "
                           f"{' or '.join(SHORT[e] for e in row.expected)}: {row.outcome} ({row.source})."
                           for row in sup.rows)
        if got is None:
            outcome = "not run yet"
        else:
            verdicts = verdict_list(got)
            outcome = (f"[{got['agree']} of {len(got['rows'])} rows agree]"
                       f"(supplements/{sup.id}/README.md) ({got['wall_s'] / 60:.1f} min): {verdicts}")
        lines += [f"- **{sup.id}** ({command}). {sup.question}{expected} Predicted: {sup.prediction} "
                  f"Result: {outcome}."]
        note = SUPPLEMENT_NOTES.get(sup.id)
        if note and got is not None and got.get("cards"):
            lines[-1] += " " + note_text(note, got["cards"])
    return lines


HELDOUT_TEXT = (
    "These designs played no part in fixing the thresholds: every threshold was fixed, and the two changed, on the "
    "main set's rows alone ([README](../README.md)). Rows, expected verdicts and the prediction below were committed "
    "before this set was first run (`lnstab/check/validation.py`, `HELDOUT`), so its agreement is the check's "
    "out-of-sample record; the main set's is in sample.")


HELDOUT_LIMITS = (
    f"Read it with its limits: {sum(r.expected == STABLE for r in HELDOUT)} of its {len(HELDOUT)} outcomes are "
    "\"stable\" (any verdict but FAIL agrees); its one FAIL row's outcome is implied by Xiong et al.'s analysis, not "
    "reported; pre-ln-nobias (its references are built without biases too) and gpt2-hf are Pre-LN built another way, "
    "so they test that the verdict survives the build, not a new design. Its row notes say so.")


def heldout_result(where: Path) -> dict[str, Any] | None:
    """The held-out set's ``summary.json`` under ``where`` (``None`` where it has not been run or does not read back
    as one)."""
    try:
        found = json.loads((where / "summary.json").read_text(encoding="utf-8"))
        return found if found.get("set") == "heldout" and isinstance(found.get("rows"), dict) else None
    except (OSError, ValueError, AttributeError):
        return None


def heldout_lines(got: dict[str, Any] | None) -> list[str]:
    """The main README's section on the held-out set: what it is, what was predicted, what came out."""
    lines = ["", "## Held-out set", "",
             f"{len(HELDOUT)} designs that played no part in fixing the thresholds, with their expected verdicts and "
             f"a prediction committed before the set first ran (`lnstab check --validate --set heldout`; "
             f"`lnstab/check/validation.py`, `HELDOUT`). Predicted: {HELDOUT_PREDICTION}", ""]
    if got is None:
        return [*lines, "Result: not run yet."]
    return [*lines, f"Result: [{got['agree']} of {len(got['rows'])} rows agree]({HELDOUT_DIR}/README.md) "
                    f"({got['wall_s'] / 60:.1f} min): {verdict_list(got)}. "
                    + constant_text([r for r in HELDOUT if r.id in got["rows"]]) + " " + HELDOUT_LIMITS]


def constant_text(rows: list[Row]) -> str:
    """What a card that always gives one verdict would score on ``rows``: the baseline the check's agreement is to be
    read against (most published outcomes are "stable", which any verdict but FAIL matches)."""
    counts = {v: sum(v in r.expected for r in rows) for v in ("warn", "pass", "fail")}
    best = max(counts, key=counts.get)
    others = ", ".join(f"always {SHORT[v]} {n}" for v, n in counts.items() if v != best)
    return (f"Baseline: a card that always said {SHORT[best]}, whatever the model, would agree on {counts[best]} of "
            f"{len(rows)} rows ({others}); the check's worth is in the rows a constant verdict gets wrong.")


def readme(rows: list[Row], cards: list[dict[str, Any]], thresholds: dict[str, Any], command: str, wall: float,
           n_runs: int, n_models: int, provenance: dict[str, Any], shape: dict[str, Any] | None = None,
           supplements: dict[str, dict[str, Any] | None] | None = None, data_text: str = "",
           heldout: dict[str, Any] | None = None, set_name: str = "main", notes: bool | None = None,
           supplement: Supplement | None = None) -> str:
    """The validation README: agreement, one row per architecture, which criteria decide which rows, thresholds,
    and (for the whole set at the default shape and protocol: ``supplements`` given) the row notes and the
    supplements found under ``<out>/supplements``; another run's rows carry no notes (those explain the default
    run's numbers), its disagreements are explained in the main README's supplement notes. ``set_name`` ``heldout``
    writes the held-out set's README (its prediction, its own row notes); ``heldout`` (that set's summary, for the
    main set's README) adds its section. ``notes``: whether the row notes are shown (default: with
    ``supplements``). ``supplement``: the supplement this run is (its question and prediction head the README)."""
    from lnstab.check.report import cell
    from lnstab.check.report import provenance as made_by

    agree = [c["status"] in r.expected for r, c in zip(rows, cards, strict=True)]
    by_row = {r.id: c for r, c in zip(rows, cards, strict=True)}  # what the row notes quote
    strict = sum(a for a, r in zip(agree, rows, strict=True) if len(r.expected) == 1)
    single = sum(len(r.expected) == 1 for r in rows)
    custom = thresholds != load_thresholds(None)
    notes = supplements is not None if notes is None else notes
    row_notes = HELDOUT_NOTES if set_name == "heldout" else NOTES
    proto = cards[0]["protocol_text"] if cards else ""
    lines = [
        "# `lnstab check` against the published record" + (": the held-out set" if set_name == "heldout" else ""),
        "",
        f"Generated by `{command}` in {wall / 60:.1f} min ({n_runs} stress runs of {n_models} distinct models; made by "
        f"{made_by(provenance)}). Every row is a card at "
        + ("the check's default shape" if not shape else
           "the check's default shape but " + ", ".join(f"`--model.{k} {v}`" for k, v in shape.items()))
        + " beside the same Pre-LN and "
        f"Peri-LN references ({reference_text(cards)}); {proto}. Data: {cards[0]['data_text'] if cards else ''}. "
        "A row identical to a reference (Pre-LN, Peri-LN) is graded against itself, so it passes every criterion "
        "where that reference sets the pass band (for Peri-LN: all of them) by construction.",
        "",
        *([HELDOUT_TEXT, "", f"Predicted before the first run: {HELDOUT_PREDICTION}", ""] if set_name == "heldout"
          else []),
        *([f"Supplement **{supplement.id}** ([the main set](../../README.md)): {supplement.question} Predicted "
           f"before the first run: {supplement.prediction}", ""] if supplement is not None else []),
        f"**Agreement: {sum(agree)} of {len(rows)} rows ({100 * sum(agree) / max(1, len(rows)):.0f} %"
        + ("; out of sample" if set_name == "heldout" else "; goal ≥ 90 %") + ")** "
        f"— {strict} of the {single} rows whose outcome implies one verdict, {sum(agree) - strict} of the "
        f"{len(rows) - single} reported stable (any verdict but FAIL agrees). Thresholds: "
        + ("**a --thresholds file, not the defaults**." if custom else
           "the defaults of `lnstab/check/criteria.py`, fixed before the set was first run"
           + (f"; {len(THRESHOLD_CHANGES)} changed after that run and every verdict re-run (see Thresholds)."
              if THRESHOLD_CHANGES else " (history below).")),
        "",
        constant_text(rows),
        "",
        "| # | architecture | published outcome (source) | implies | card | agrees | decided by / why |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, (row, card, ok) in enumerate(zip(rows, cards, agree, strict=True), 1):
        implies = " or ".join(SHORT[e] for e in row.expected)
        decided = ", ".join(f"`{c}`" for c in deciding(card)) or "every criterion passes"
        note = note_text(row_notes.get(row.id, ""), by_row) if notes else ""
        why = decided + (f"; {note}" if note else "" if ok or not notes else "; not yet explained")
        lines.append(f"| {i} | [{cell(row.design)}]({row.id}/report.md) | {cell(row.outcome)} ({cell(row.source)}) | "
                     f"{implies} | **{SHORT[card['status']]}** | {'yes' if ok else '**no**'} | {cell(why)} |")
    lines += ["", "## Each criterion on each row", "",
              "| row | " + " | ".join(c.id for c in CRITERIA) + " |", "|---|" + "---|" * len(CRITERIA)]
    for row, card in zip(rows, cards, strict=True):
        st = statuses(card)
        lines.append(f"| {row.id} | " + " | ".join(SHORT[st[c.id]] for c in CRITERIA) + " |")
    lines += ["", "Which rows each criterion decides (its status is the card's verdict):", ""]
    for c in CRITERIA:
        decided = {level: [r.id for r, k in zip(rows, cards, strict=True)
                           if k["status"] == level and statuses(k)[c.id] == level] for level in ("fail", "warn")}
        fails, warns = decided["fail"], decided["warn"]
        lines.append(f"- `{c.id}`: fails {', '.join(fails) or 'no row'}; is among the warnings of "
                     f"{', '.join(warns) or 'no row'}")
    lines += ["", "## Thresholds", "",
              "The thresholds and the expected verdicts were committed before the set was run "
              "(`lnstab/check/criteria.py`, `lnstab/check/validation.py`); their history, oldest first:", ""]
    lines += [f"- `{h}`" for h in history()] or ["- (not a git checkout)"]
    lines += ["", "Changes after the first run: " + ("; ".join(THRESHOLD_CHANGES) if THRESHOLD_CHANGES else
                                                     "none; every verdict above is from the thresholds fixed before "
                                                     "it.")]
    if ROW_CHANGES:
        lines += ["", "Rows changed after their first run (every verdict re-run): " + "; ".join(ROW_CHANGES) + "."]
    if DEFAULT_THRESHOLDS != load_thresholds(None):
        lines.append("(The module's defaults differ from its YAML: this should not happen.)")
    if heldout is not None or set_name == "main" and supplements is not None:
        lines += heldout_lines(heldout)
    if supplements is not None:
        lines += supplement_lines(supplements, data_text)
    lines.append("")
    return "\n".join(lines)
