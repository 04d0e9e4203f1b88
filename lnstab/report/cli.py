"""The paper's tables (Markdown, CSV) and figures (PNG) from run directories alone.

``lnstab report RUN_OR_GRID_DIR… --out DIR`` reads the runs and writes the report.

Writes into ``DIR``: ``report.md`` (every table and figure, with the runs' statuses), ``divergence.{md,csv}``,
``performance.{md,csv}``, ``stability.{md,csv}``, ``lr_sensitivity.{md,csv}``, ``logits.{md,csv}``, ``runs.{md,csv}``
(one row per run) and the PNG figures of
:mod:`lnstab.report.figures`. Nothing is overwritten unless ``--overwrite`` is given. A run with a damaged file is
named in one line on stderr and in ``report.md``, and counted in the tables as ``damaged``; the rest is reported.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from lnstab.errors import LNStabError, writing
from lnstab.report.collect import RunRecord, collect
from lnstab.report.figures import FIGURES, draw_all
from lnstab.report.ladder import ladder_table
from lnstab.report.logits import logit_table
from lnstab.report.lr_sensitivity import lr_sensitivity_table
from lnstab.report.tables import divergence_table, group, performance_table, runs_table, stability_table
from lnstab.rundir import atomic_write_text, check_writable
from lnstab.sweep.cli import OneLineParser

TABLES = {
    "divergence": ("Divergence: runs diverged (k of the n that finished) per configuration, with the steps",
                   divergence_table),
    "performance": ("Performance: mean ± std over the completed runs (n = used/all)", performance_table),
    "stability": ("Stability: end of training, mean ± std over the runs with data (n = used/all)", stability_table),
    "lr_sensitivity": ("LR sensitivity (Wortsman et al. 2023): mean over the learning-rate ladder of "
                       "min(L, L_init) − L* per configuration, of the losses averaged over seeds first",
                       lr_sensitivity_table),
    "lr_ladder": ("LR sensitivity per seed: each seed's own ladder against its own L*, then the mean with Student's "
                  "95 % interval (never below the seed-averaged value above, since each seed's L* is its own "
                  "minimum), the difference to the first configuration with Welch's, and the final loss at each rate "
                  "as mean [min, max] over seeds", ladder_table),
    "logits": ("Attention and output logits: largest attention logit (over layers and steps), smallest attention "
               "entropy, largest collapsed fraction, last mean log Z, largest output logit; mean ± std over runs",
               logit_table),
    "runs": ("Runs", runs_table),
}


def runs_text(n: int) -> str:
    """``1 run``, ``8 runs``."""
    return f"{n} run" if n == 1 else f"{n} runs"


def build_parser() -> argparse.ArgumentParser:
    """The ``lnstab report`` argument parser."""
    p = OneLineParser(prog="lnstab report", description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", metavar="RUN_OR_GRID_DIR", help="run directories or directories of runs")
    p.add_argument("--out", required=True, help="directory for the tables (Markdown, CSV) and figures (PNG)")
    p.add_argument("--overwrite", action="store_true", help="replace the files of an earlier report in --out")
    p.add_argument("--pool", nargs="+", default=[], metavar="KEY",
                   help="config keys that do not make a configuration (e.g. trainer.accelerator, for a grid run "
                        "partly on a GPU): runs that differ only in these are pooled; report.md says how")
    return p


def _value_order(item: tuple[str, int]) -> tuple[int, float, str]:
    """Numbers first, in their order (6 before 20), then the other values as text."""
    try:
        return 0, float(item[0]), ""
    except ValueError:
        return 1, 0.0, item[0]


def pool(records: list[RunRecord], keys: list[str]) -> list[str]:
    """Drop ``keys`` (dotted config paths) from every record's config; returns report.md's lines saying what was
    pooled (each key's values and their run counts).

    Raises:
        LNStabError: A key no run's config has (one line naming it).
    """
    lines = []
    for key in keys:
        counts: dict[str, int] = {}
        for r in records:
            if key in r.config:
                value = r.config.pop(key)
                counts[str(value)] = counts.get(str(value), 0) + 1
        if not counts:
            raise LNStabError(f"--pool {key}: no run's config has this key; give a dotted config key such as "
                              f"trainer.accelerator")
        said = (f"{v} ({n} run{'s' * (n != 1)})" for v, n in sorted(counts.items(), key=_value_order))
        lines.append(f"Pooled over `{key}`: " + ", ".join(said) + ".")
    return lines


def outputs() -> list[str]:
    """The file names a report writes."""
    return ["report.md", *(f"{n}.{ext}" for n in TABLES for ext in ("md", "csv")), *FIGURES]


def write_report(records: list[RunRecord], out: Path, command: str = "", notes: list[str] | None = None
                 ) -> dict[str, Path | None]:
    """Write every table and figure of ``records`` into ``out``; returns the figures (``None``: no data). ``notes``:
    lines for report.md's head (what was pooled)."""
    out.mkdir(parents=True, exist_ok=True)
    tables = {name: make(records) for name, (_, make) in TABLES.items()}
    for name, table in tables.items():
        atomic_write_text(out / f"{name}.md", table.to_markdown())
        atomic_write_text(out / f"{name}.csv", table.to_csv())
    _, configs = group(records)
    figures = draw_all(configs, out)
    for name, drawn in figures.items():  # an earlier report's figure these runs have no data for (--overwrite)
        if drawn is None:
            (out / name).unlink(missing_ok=True)
    lines = ["# lnstab report", ""]
    if command:
        lines += [f"Generated by `{command}`.", ""]
    counts: dict[str, int] = {}
    for r in records:
        counts[r.status] = counts.get(r.status, 0) + 1
    lines += [f"{runs_text(len(records))} in {len(configs)} configuration(s): "
              + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + ".", ""]
    for note in notes or []:
        lines += [note, ""]
    damaged = [r for r in records if r.problem]
    if damaged:
        lines += ["Damaged runs (counted in the tables' n, none of their data used):", ""]
        lines += [f"- `{r.name}`: {r.problem}" for r in damaged] + [""]
    for name, (title, _) in TABLES.items():
        lines += [f"## {title}", "", tables[name].to_markdown(), f"CSV: [{name}.csv]({name}.csv)", ""]
    lines += ["## Figures", ""]
    for name, (title, _) in FIGURES.items():
        if figures[name] is None:
            lines += [f"- {title}: no run has the data.", ""]
        else:
            lines += [f"### {title[0].upper()}{title[1:]}", "", f"![{title}]({name})", ""]
    atomic_write_text(out / "report.md", "\n".join(lines))
    return figures


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``lnstab report`` (``argv`` without the subcommand)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    for given in args.paths:  # a report inside a directory of runs is read as a stranger there by the next report
        if out.resolve().is_relative_to(Path(given).resolve()):
            raise LNStabError(f"--out {out} is not allowed inside {given}, which is read as runs (a later report of it "
                              "would find the report's directory there): choose a directory outside it")
    check_writable(out, "--out")  # a file in the way, a dangling link, no write permission: one line, before reading
    if not args.overwrite:
        taken = [name for name in outputs() if (out / name).exists()]
        if taken:
            raise LNStabError(f"--out {out} already holds a report ({taken[0]}); choose another directory or pass "
                              f"--overwrite")
    records = collect(args.paths)
    if not records:
        raise LNStabError(f"no runs found in {', '.join(args.paths)}")
    notes = pool(records, args.pool)
    with writing(out):  # a full disk: one line naming the file (or --out) and the OS's reason, exit 1
        figures = write_report(records, out, command=shlex.join(["lnstab", "report", *argv]), notes=notes)
    drawn = [n for n, p in figures.items() if p is not None]
    print(f"lnstab report: {runs_text(len(records))} -> {out}/report.md, {len(TABLES)} tables (md + csv), "
          f"{len(drawn)} figures")
