"""The report card as terminal text, ``report.md`` and ``report.json``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jinja2
import yaml

from lnstab.check.subjects import REFERENCES
from lnstab.formatting import card_number as num
from lnstab.formatting import cell
from lnstab.rundir import atomic_write_text, write_json

SCHEMA = 2
MARK = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "n/a": "n/a"}
# What a check that wrote no card leaves in its run directory instead (lnstab.check.cli), which --compare names.
INTERRUPTED, ERROR = "interrupted.txt", "error.txt"  # a signal ended it; it failed (the traceback)


def threshold(row: dict[str, Any], level: str, rule: bool = False) -> str:
    """``> 0.123`` (with ``rule``: ``> 0.123 (`max(pre, peri)`)``) or ``–`` (never)."""
    value = row.get(level)
    if value is None or not math.isfinite(value):
        return "–"
    return f"> {num(value)}" + (f" (`{row[level + '_rule']}`)" if rule else "")


def reference_keys(card: dict[str, Any]) -> list[str]:
    """The references present in the card, in a fixed order."""
    return [k for k in REFERENCES if k in card["references"]]


def terminal(card: dict[str, Any]) -> str:
    """The card as fixed-width text: a header, the table, then one line per criterion saying why."""
    refs = reference_keys(card)
    head = ["criterion", "measured", *[card["references"][k]["short"] for k in refs], "warn", "fail", "status"]
    rows = [[r["title"], num(r["measured"]), *[num(r["references"].get(k)) for k in refs], threshold(r, "warn"),
             threshold(r, "fail"), MARK[r["status"]]] for r in card["criteria"]]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()  # noqa: E731
    out = [
        f"lnstab check: {card['model']['label']} — {MARK[card['status']]}",
        f"  {card['model']['description']}; {card['protocol_text']}",
        *([f"  {tier_text(card['tier'])}"] if card.get("tier") else []),
        *([f"  {cached}"] if (cached := cached_text(card)) else []),
        *([f"  weights shared across depth: {repeated_text(card['model']['repeated'])}"]
          if card["model"].get("repeated") else []),
        "",
        line(head),
        line(["-" * w for w in widths]),
        *[line(r) for r in rows],
        "",
        *[f"  {MARK[r['status']]:4s} {r['title']}: {r['why']}" for r in card["criteria"]],
        "",
        f"report: {card.get('_out', card['out'])}/report.md  (exit {card['exit_code']}, {card['wall_s']:.0f} s)",
    ]
    return "\n".join(out) + "\n"


def cached_text(card: dict[str, Any]) -> str:
    """How many reference runs an earlier card's identical runs stood in for (``lnstab.check.cache``); ``""`` for
    none."""
    runs = card.get("runs", ())
    cached = [r for r in runs if r.get("cached")]
    if not cached:
        return ""
    refs = sorted({r["subject"] for r in cached})
    return (f"Reused: {len(cached)} of {len(runs)} stress runs ({', '.join(refs)}) are an earlier card's identical "
            "reference runs (same config, protocol, token windows, lnstab source, torch, CPU kind and threads), not "
            "trained again; `--no-cache` trains them afresh")


def markdown(card: dict[str, Any]) -> str:
    """``report.md`` (the template ``report.md``): the same card with rules, figures and every run."""
    return TEMPLATES.get_template("report.md").render(card=card, refs=reference_keys(card), cached=cached_text(card))


def tier_text(tier: dict[str, Any]) -> str:
    """What a card of a tier other than quick says of its tier (lnstab/check/tiers.yaml)."""
    return (f"Tier: {tier['name']} (--tier {tier['name']}). It sees {tier['sees']}. It cannot see "
            f"{tier['cannot_see']}.")


def repeated_text(repeated: dict[str, int]) -> str:
    """What the card says of blocks that one forward runs several times."""
    runs = ", ".join(f"`{name}` runs {n} times" for name, n in repeated.items())
    return (f"{runs} in one forward; each call is measured as a layer of its own, in call order (hidden-state growth, "
            "the Jacobian probe, Theorem 4's bound, whose sum counts an output norm once per call), while per-layer "
            "gradient norms, which belong to parameters, do not tell the calls apart")


def provenance(p: dict[str, Any]) -> str:
    """``lnstab 0.1.0 (commit …) on AMD EPYC (2 cores, AVX512, native bf16), 2 workers × 1 thread, torch 2.13``
    (a card made before the ISA was recorded names none)."""
    m = p.get("machine", {})
    bf16 = {True: "native bf16", False: "no native bf16", None: "bf16 support unknown"}[m.get("native_bf16")]
    workers = m.get("workers", 1)
    threads = m.get("threads_per_worker", 1)
    isa = f"{m['isa']}, " if m.get("isa") else ""
    return (f"lnstab {p.get('lnstab', '?')} on {m.get('cpu', '?')} ({m.get('cores', '?')} cores, {isa}{bf16}), "
            f"{workers} worker{'s' if workers != 1 else ''} × {threads} thread{'s' if threads != 1 else ''}, "
            f"torch {m.get('torch', '?')}")


def write_report(out: Path, card: dict[str, Any], thresholds: dict[str, Any]) -> None:
    """``report.md``, ``report.json`` and the resolved ``thresholds.yaml`` into ``out`` (each written atomically)."""
    atomic_write_text(out / "report.md", markdown(card))
    write_json(out / "report.json", {"schema": SCHEMA, **{k: v for k, v in card.items() if not k.startswith("_")}})
    atomic_write_text(out / "thresholds.yaml", yaml.safe_dump(thresholds, sort_keys=False))


# The card's and the validation READMEs' Markdown templates (report.md here, validation/*.md); a missing value raises.
TEMPLATES = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent), autoescape=False,
                               keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
                               undefined=jinja2.StrictUndefined)
TEMPLATES.filters.update(cell=cell, mark=MARK.__getitem__, num=num, threshold=threshold, tier_text=tier_text,
                         repeated_text=repeated_text, provenance=provenance)
