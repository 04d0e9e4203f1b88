"""The paper's tables from run records: divergence, performance and stability, as Markdown and CSV.

Runs are grouped into *configurations* by the config keys whose values differ between the runs, seeds left out
(``seed_everything`` and any ``*.seed``): the five seeds of ``pre_wd0.1`` form one configuration. Every run counts
in its configuration's ``n``, also when it is missing, running, interrupted or failed:

* **divergence**: ``diverged`` = k/n over the runs that finished (completed or diverged), with each divergence step;
  ``unfinished`` counts the others by status; for each recorded-only event kind (``attention_collapse``,
  ``logit_drift``: DivergenceMonitor's non-fatal events) the finished runs that had one, with the first step of each.
* **performance**: mean ± sample std over the *completed* runs that have the metric; ``n`` = used/all runs.
  Diverged runs are left out (their scores describe a broken model), and show in ``n``.
* **stability**: mean ± std over every run with the series (a diverged run at its last finite record): last-layer
  MA, entry-wise and data-wise variance (``hidden_stats.json``, the final-norm input), the largest |x| anywhere (fp16
  overflows at 65504), the growth-law fits and Theorem 4's slack (minimum over training) and violations, the
  Jacobian sensitivity at the last probe (largest over layers) and the log-log slope of sensitivity against
  activation scale over every layer and probe.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from lnstab.formatting import cell, mean_pm, number, text
from lnstab.measures import FP16_MAX, SENSITIVITY, jacobian_points, log_log_slope
from lnstab.moduleargs import MODEL_DEFAULTS, TRAINING_DEFAULTS
from lnstab.report.collect import RunRecord
from lnstab.validation import is_number

WATCHED_EVENTS = ("attention_collapse", "logit_drift")  # non-fatal DivergenceMonitor kinds the divergence table shows
PERFORMANCE_METRICS = ("val_loss", "eval_loss", "ppl_exp_mean_loss", "ppl_mean_seq", "rouge1", "rouge2", "rougeL",
                       "bertscore_precision", "bertscore_recall", "bertscore_f1")
STABILITY_METRICS = ("ma_last", "var_entry_last", "var_data_last", "max_abs", "growth_exp_rate", "growth_exp_r2",
                     "growth_linear_slope", "growth_linear_r2", "thm4_slack_min", "thm4_violations",
                     "jacobian_sensitivity_max", "jacobian_scale_slope")


def is_seed(key: str) -> bool:
    """Whether a config key is a seed (``seed_everything``, ``*.seed``): replicates, not configurations."""
    return key == "seed_everything" or key.rsplit(".", 1)[-1] == "seed"


def _norm(value: Any) -> str:
    if is_number(value):
        return repr(float(value))
    return json.dumps(value, sort_keys=True, default=str)


KEY_ORDER = ("model.", "data.", "trainer.")  # which of several co-varying keys names a configuration


def varying_keys(records: list[RunRecord]) -> list[str]:
    """Config keys (seeds excluded) whose values differ between the records: ``model.*`` first, then ``data.*``,
    ``trainer.*`` and the rest. A list or mapping value that splits the runs no further than the keys before it
    (it varies with them, e.g. a callback list that a grid sets together with the learning rate) is left out."""
    keys: dict[str, None] = {}
    for r in records:
        keys.update(dict.fromkeys(r.config))
    differing = [k for k in keys if not is_seed(k) and len({_norm(r.config.get(k)) for r in records}) > 1]
    differing.sort(key=lambda k: next((i for i, p in enumerate(KEY_ORDER) if k.startswith(p)), len(KEY_ORDER)))
    kept: list[str] = []
    groups = 1
    for key in differing:
        finer = len({tuple(_norm(r.config.get(k)) for k in (*kept, key)) for r in records})
        scalar = all(not isinstance(r.config.get(key), list | dict) for r in records)
        if finer > groups or scalar:
            kept.append(key)
            groups = finer
    return kept


def short_names(keys: list[str]) -> dict[str, str]:
    """Column names: each key's last part, or the whole key where two last parts coincide."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last, strict=True)}


# Legend names of the paper's axes; the placement is named by its value alone ("pre, Δt=0.1, lr=0.01").
LABELS = {"norm_placement": "", "residual_scale": "Δt", "learning_rate": "lr", "weight_decay": "wd"}


# Model options at their "off" value, GPTModule's default, say nothing in a legend; switched on, a boolean is named
# alone.
OFF = {k: v for k, v in {**MODEL_DEFAULTS, **TRAINING_DEFAULTS}.items()
       if k in ("qk_norm", "z_loss", "residual_gate", "norm_type", "compile")}


def label_part(name: str, value: Any) -> str:
    """``name=value`` for a figure legend, shortened for the paper's axes; ``""`` for a model option that is off
    (``qk_norm=False``, ``z_loss=0``, ``residual_gate=none``, ``norm_type=layernorm``), the name alone for a boolean
    that is on (``qk_norm``)."""
    short = LABELS.get(name, name)
    if name in OFF and _norm(value) == _norm(OFF[name]):
        return ""
    if value is True:
        return short
    return f"{short}={_show(value)}" if short else _show(value)


def config_label(names: dict[str, str], values: dict[str, Any]) -> str:
    """A configuration's legend name: its :func:`label_part` s; where every one is an option that is off (Pre-LN
    beside Pre-LN + QK-norm: ``qk_norm=False``), the values written out, since an empty name would read as "all
    runs"; ``all runs`` only where nothing varies."""
    label = join_label([label_part(names[k], v) for k, v in values.items()])
    if label or not values:
        return label or "all runs"
    return join_label([f"{LABELS.get(names[k], names[k]) or names[k]}={_show(v)}" for k, v in values.items()])


def join_label(parts: list[str]) -> str:
    """Legend parts joined with ``, ``, the empty ones left out."""
    return ", ".join(p for p in parts if p)


@dataclass
class Configuration:
    """Runs that share every varying config value but the seed."""

    values: dict[str, Any]
    label: str
    runs: list[RunRecord] = field(default_factory=list)


def group(records: list[RunRecord]) -> tuple[list[str], list[Configuration]]:
    """``(varying keys, configurations in first-seen order)``."""
    keys = varying_keys(records)
    names = short_names(keys)
    groups: dict[tuple[str, ...], Configuration] = {}
    for r in records:
        ident = tuple(_norm(r.config.get(k)) for k in keys)
        if ident not in groups:
            values = {k: r.config.get(k) for k in keys}
            label = config_label(names, values)
            groups[ident] = Configuration(values, label)
        groups[ident].runs.append(r)
    return keys, list(groups.values())


def _show(value: Any) -> str:
    if isinstance(value, float):
        return format(value, "g")
    return str(value) if not isinstance(value, list | dict) else json.dumps(value)


@dataclass
class Table:
    """Rows of cells under named columns; Markdown cells may differ from the CSV's numbers."""

    columns: list[str]
    rows: list[dict[str, Any]]
    markdown_columns: list[str]
    markdown_rows: list[dict[str, str]]

    def to_csv(self) -> str:
        """The table as CSV (numbers unrounded, missing values empty)."""
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=self.columns, lineterminator="\n")
        writer.writeheader()
        for row in self.rows:
            writer.writerow({c: _csv_cell(row.get(c)) for c in self.columns})
        return out.getvalue()

    def to_markdown(self) -> str:
        """The table as a Markdown pipe table (``mean ± std`` cells)."""
        cols = self.markdown_columns
        lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
        for row in self.markdown_rows:
            lines.append("| " + " | ".join(cell(row.get(c, "")) for c in cols) + " |")
        return "\n".join(lines) + "\n"


def _csv_cell(value: Any) -> Any:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return value


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (``nan`` std for one value, both ``nan`` for none)."""
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def _key_cells(keys: list[str], config: Configuration) -> dict[str, Any]:
    names = short_names(keys)
    return {names[k]: _show(config.values[k]) for k in keys}


def _status_counts(runs: list[RunRecord], exclude: tuple[str, ...]) -> str:
    counts: dict[str, int] = {}
    for r in runs:
        if r.status not in exclude:
            counts[r.status] = counts.get(r.status, 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))


def divergence_table(records: list[RunRecord]) -> Table:
    """k/n runs diverged per configuration, with each divergence step."""
    keys, configs = group(records)
    names = list(short_names(keys).values())
    rows, md = [], []
    for c in configs:
        finished = [r for r in c.runs if r.status in ("completed", "diverged")]
        diverged = [r for r in finished if r.status == "diverged"]
        steps = sorted(s for s in (r.diverged_step for r in diverged) if s is not None)
        cells = _key_cells(keys, c)
        row = {**cells, "runs": len(c.runs), "finished": len(finished), "diverged": len(diverged),
               "divergence_steps": " ".join(map(str, steps)), "unfinished": _status_counts(c.runs, ("completed",
                                                                                                    "diverged"))}
        mrow = {**cells, "diverged (k/n)": f"{len(diverged)}/{len(finished)}",
                "divergence steps": ", ".join(map(str, steps)) or "–", "runs": str(len(c.runs)),
                "unfinished": row["unfinished"] or "–"}
        for kind in WATCHED_EVENTS:
            firsts = sorted(s for s in (first_event_step(r, kind) for r in finished) if s is not None)
            row[kind], row[f"{kind}_steps"] = len(firsts), " ".join(map(str, firsts))
            mrow[kind.replace("_", " ")] = f"{len(firsts)}/{len(finished)}" + (
                f" (from {', '.join(map(str, firsts))})" if firsts else "")
        rows.append(row)
        md.append(mrow)
    watched = [c for kind in WATCHED_EVENTS for c in (kind, f"{kind}_steps")]
    return Table([*names, "runs", "finished", "diverged", "divergence_steps", "unfinished", *watched], rows,
                 [*names, "diverged (k/n)", "divergence steps", "runs", "unfinished",
                  *(k.replace("_", " ") for k in WATCHED_EVENTS)], md)


def first_event_step(run: RunRecord, kind: str) -> int | None:
    """The first step at which the run recorded an event of ``kind`` (``None``: never)."""
    steps = [e["step"] for e in run.events if e.get("kind") == kind and isinstance(e.get("step"), int)]
    return min(steps) if steps else None


def performance_table(records: list[RunRecord]) -> Table:
    """Val loss, both perplexities, ROUGE-1/2/L, BERTScore P/R/F1: mean ± std over the completed runs; and where
    the runs' ``eval.json`` give it, ``copy_rate``, the fraction of teacher-forced predictions that repeat their
    input token (such a prediction scores ROUGE ≈ 1: read ROUGE beside it)."""
    return _metric_table(records, performance_metrics(records), lambda r: r.metrics if r.status == "completed" else {}
                         )[0]


def performance_metrics(records: list[RunRecord]) -> tuple[str, ...]:
    """:data:`PERFORMANCE_METRICS`, and ``copy_rate`` where a run has it (reports of older runs keep their columns)."""
    return PERFORMANCE_METRICS + (("copy_rate",) if any("copy_rate" in r.metrics for r in records) else ())


def stability_table(records: list[RunRecord]) -> Table:
    """Last-layer MA and variances, max |x| (and how many runs went past fp16's range), growth law, Theorem 4
    slack/violations, Jacobian sensitivity."""
    table, configs = _metric_table(records, STABILITY_METRICS, stability_metrics)
    at = table.columns.index("runs") + 1
    table.columns.insert(at, "over_fp16")
    table.markdown_columns.insert(table.markdown_columns.index("n") + 1, "over fp16")
    for row, md, c in zip(table.rows, table.markdown_rows, configs, strict=True):
        over = sum(1 for r in c.runs if stability_metrics(r).get("max_abs", 0.0) >= FP16_MAX)
        row["over_fp16"] = md["over fp16"] = over
    return table


def _metric_table(records: list[RunRecord], metrics: tuple[str, ...], values_of: Any
                  ) -> tuple[Table, list[Configuration]]:
    keys, configs = group(records)
    names = list(short_names(keys).values())
    rows, md = [], []
    fewer: set[str] = set()  # metrics some configuration has from fewer runs than its n
    for c in configs:
        per_run = [values_of(r) for r in c.runs]
        used = [v for v in per_run if any(m in v for m in metrics)]
        cells = _key_cells(keys, c)
        row: dict[str, Any] = {**cells, "n": len(used), "runs": len(c.runs)}
        mrow = {**cells, "n": f"{len(used)}/{len(c.runs)}"}
        for m in metrics:
            values = [v[m] for v in used if m in v]
            mean, std = mean_std(values)
            row[f"{m}_mean"], row[f"{m}_std"], row[f"{m}_n"] = mean, std, len(values)
            mrow[m] = mean_pm(mean, std)
            if 0 < len(values) < len(used):  # n counts runs with any of the metrics: say this one's own count
                mrow[m] += f" (n={len(values)})"
                fewer.add(m)
        rows.append(row)
        md.append(mrow)
    columns = [*names, "n", "runs", *(f"{m}_{s}" for m in metrics
                                      for s in ("mean", "std", *(("n",) if m in fewer else ())))]
    return Table(columns, rows, [*names, "n", *metrics], md), configs


def _last_finite(values: list[float]) -> float | None:
    for v in reversed(values):
        if isinstance(v, int | float) and math.isfinite(v):
            return float(v)
    return None


def last_site(hidden: dict[str, Any]) -> str | None:
    """The site of the last layer's output: ``final`` (the final-norm input) or the deepest layer's last tag."""
    tags = hidden.get("tags") or []
    if "final" in tags:
        return "final"
    layers = [t for t in tags if t.startswith("L")]
    return layers[-1] if layers else None


def stability_metrics(run: RunRecord) -> dict[str, float]:
    """One run's stability numbers (absent keys: the run has no such data)."""
    out: dict[str, float] = {}
    hidden = run.hidden or {}
    stats = hidden.get("stats") or {}
    site = last_site(hidden) if hidden else None
    if site:
        for stat, name in (("mean_abs", "ma_last"), ("var_entry", "var_entry_last"), ("var_data", "var_data_last")):
            value = _last_finite((stats.get(stat) or {}).get(site, []))
            if value is not None:
                out[name] = value
        peaks = [v for series in (stats.get("max_abs") or {}).values() for v in series
                 if isinstance(v, int | float) and not math.isnan(v)]
        if peaks:
            out["max_abs"] = max(peaks)
    for tag, name in (("growth/exp_rate", "growth_exp_rate"), ("growth/exp_r2", "growth_exp_r2"),
                      ("growth/linear_slope", "growth_linear_slope"), ("growth/linear_r2", "growth_linear_r2"),
                      ("bound/violations", "thm4_violations")):
        value = _last_finite([v for _, v in run.series(tag)])
        if value is not None:
            out[name] = value
    slack = [v for _, v in run.series("bound/slack") if math.isfinite(v)]
    if slack:
        out["thm4_slack_min"] = min(slack)
    sens, points = jacobian_last(run), jacobian_pairs(run)
    if sens:
        out["jacobian_sensitivity_max"] = max(sens)
    if len(points) >= 2:
        slope = log_log_slope(points)["slope"]
        if math.isfinite(slope):
            out["jacobian_scale_slope"] = slope
    return out


def jacobian_last(run: RunRecord) -> list[float]:
    """The Jacobian sensitivity of each layer at its last probe (the finite ones)."""
    scalars = run.scalars()
    series = [dict(v) for t, v in scalars.items() if t.startswith(SENSITIVITY) and v]
    return [value for sens in series if math.isfinite(value := sens[max(sens)])]


def jacobian_pairs(run: RunRecord) -> list[tuple[float, float]]:
    """:func:`lnstab.measures.jacobian_points` of a run: every layer (in name order) and probe."""
    return jacobian_points(dict(sorted(run.scalars().items())))


def runs_table(records: list[RunRecord]) -> Table:
    """One row per run: its configuration, status, steps and every metric (the tables' raw material)."""
    keys = varying_keys(records)
    names = short_names(keys)
    seeds = sorted({k for r in records for k in r.config if is_seed(k)})
    metric_cols = [*performance_metrics(records), *STABILITY_METRICS]
    rows, md = [], []
    for r in records:
        values = {**r.metrics, **stability_metrics(r)} if r.status != "missing" else {}
        row = {"run": r.name, **{names[k]: _show(r.config.get(k)) for k in keys},
               **{s: r.config.get(s) for s in seeds if r.config.get(s) is not None}, "status": r.status,
               "final_step": r.summary.get("final_step"), "diverged_step": r.diverged_step,
               "wall_s": r.summary.get("wall_s"), **{m: values.get(m) for m in metric_cols}, "path": str(r.path)}
        rows.append(row)
        md.append({"run": r.name, "status": r.status, "step": text(row["final_step"]),
                   "diverged at": text(row["diverged_step"]), "val_loss": number(values.get("val_loss")),
                   "ma_last": number(values.get("ma_last")), "max_abs": number(values.get("max_abs"))})
    columns = ["run", *names.values(), *seeds, "status", "final_step", "diverged_step", "wall_s", *metric_cols,
               "path"]
    return Table(columns, rows, ["run", "status", "step", "diverged at", "val_loss", "ma_last", "max_abs"], md)
