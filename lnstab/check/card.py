"""The rows of the report card: each criterion's value, the references' values, thresholds, status and why."""

from __future__ import annotations

import math
from typing import Any

from lnstab.check.criteria import BY_ID, CRITERIA, LABELS, resolve, status


def relation(cid: str, value: float, refs: dict[str, tuple[float, float]]) -> str:
    """``grows like Pre-LN`` / ``… than both references`` / ``between Peri-LN and Pre-LN`` (empty without refs)."""
    finite = {k: v for k, v in refs.items() if math.isfinite(v[0])}
    phrases = BY_ID[cid].phrases if cid in BY_ID else None
    if phrases is None or not finite or not math.isfinite(value):
        return ""
    near, low, high = phrases
    margin = 2 * max([0.0] + [v[1] for v in finite.values() if math.isfinite(v[1])])  # as the default thresholds
    tolerance = max(margin, 1e-12 * max(1.0, abs(value)))
    distance = {k: abs(value - v[0]) for k, v in finite.items()}
    close = sorted((k for k in finite if distance[k] <= tolerance), key=distance.get)
    if close:
        ref = "both references" if len(close) == 2 else LABELS[close[0]]
        insensitive = {"both references": "responds like both references", "Pre-LN": "as sensitive as Pre-LN",
                       "Peri-LN": "as insensitive as Peri-LN"}[ref]
        return near.format(ref=ref, insensitive=insensitive)
    if value < min(v[0] for v in finite.values()):
        return low
    if value > max(v[0] for v in finite.values()):
        return high
    return "between " + " and ".join(LABELS[k] for k in sorted(finite, key=lambda k: finite[k][0]))


def build_rows(summaries: dict[str, dict[str, Any]], thresholds: dict[str, dict[str, Any]],
               sites: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per criterion for the subject ``checked`` against the others in ``summaries``."""
    checked = summaries["checked"]
    ref_summaries = {k: v for k, v in summaries.items() if k != "checked"}
    rows = []
    for criterion in CRITERIA:
        cid = criterion.id
        value, sd = criterion.value(checked)
        refs = {k: criterion.value(v) for k, v in ref_summaries.items()}
        limits = resolve(thresholds[cid], refs or None, {"loss_init": checked.get("loss_init", math.nan)})
        verdict = status(value, limits)
        if not math.isfinite(value) and criterion.missing is not None:
            text = criterion.missing(checked, sites)
        else:  # what was measured, how it compares, then the references' values
            rel = relation(cid, value, refs)
            text = criterion.explain(checked, value, sd, ref_summaries) + (f"; {rel}" if rel else "")
            if criterion.quote is not None and ref_summaries:
                text += f" ({', '.join(f'{LABELS[k]} {criterion.quote(r)}' for k, r in ref_summaries.items())})"
        if verdict == "warn" and thresholds[cid].get("kind") == "mechanism":
            text += f"; {criterion.mechanism}"
        rows.append({
            "id": cid,
            "title": criterion.title,
            "unit": criterion.unit,
            "measured": value,
            "sd": sd,
            "references": {k: v[0] for k, v in refs.items()},
            **limits,
            "status": verdict,
            "why": text,
        })
    return rows
