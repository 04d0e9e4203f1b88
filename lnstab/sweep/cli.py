"""Run a grid of experiments here or as a SLURM job array, resumably (--dry-run, --status, --parallel N).

``lnstab sweep GRID.yaml`` expands a grid, validates it, runs it here, prints its status, or writes its cluster job.

Examples::

    lnstab sweep experiments/grids/gpt2_divergence.yaml --dry-run        # runs and their overrides
    lnstab sweep experiments/grids/mini.yaml                             # one run after another, here
    lnstab sweep experiments/grids/mini.yaml --parallel 2                # two child processes at a time
    lnstab sweep experiments/grids/mini.yaml --status                    # pending/running/completed/… table
    lnstab sweep experiments/grids/gpt2_perf.yaml --slurm | sbatch       # one job-array element per run
    lnstab sweep experiments/grids/gpt2-xl_perf.yaml --torchrun --nodes 2  # commands for bare machines

Rerunning the same command is safe: finished runs are skipped, interrupted ones resume from ``last.ckpt``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import fnmatch
import io
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from lnstab.errors import LNStabError, writing
from lnstab.safeload import check_yaml_text
from lnstab.sweep.grid import Grid, GridError, Run, check_key, load_grid
from lnstab.sweep.runner import LocalSweep, fit_command, format_duration, status_rows
from lnstab.sweep.slurm import sbatch_script, slurm_settings, torchrun_commands
from lnstab.sweep.state import (
    check_manifest,
    check_sweep_dirs,
    journal,
    launched,
    move_aside,
    plan,
    record_manifest,
    run_directory,
    sweep_dir,
)
from lnstab.validation import is_number


class OneLineParser(argparse.ArgumentParser):
    """argparse with lnstab's one-line errors (exit status 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        """Print ``lnstab: error: <message> (see: … --help)`` and exit 2."""
        sys.stderr.write(f"lnstab: error: {message} (see: {self.prog} --help)\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    """The ``lnstab sweep`` argument parser."""
    p = OneLineParser(prog="lnstab sweep", description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("grid", help="grid YAML (experiments/grids/*.yaml)")
    p.add_argument("--root", default="runs", help="directory of the grids' run directories (default: runs)")
    p.add_argument("--only", nargs="+", metavar="RUN", help="only these runs (names or shell patterns)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key in every run (YAML value); recorded with the runs")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="validate and list the runs and their overrides")
    mode.add_argument("--status", action="store_true", help="table of the runs' status (reads the run directories)")
    mode.add_argument("--slurm", action="store_true", help="print the sbatch job-array script (pipe it to sbatch)")
    mode.add_argument("--torchrun", action="store_true", help="print torchrun commands for bare multi-node machines")
    mode.add_argument("--prepare", metavar="RUN", help="(job scripts) settle one run; print start|resume|skip")
    p.add_argument("--parallel", type=int, default=1, metavar="N", help="child processes at a time (default 1)")
    p.add_argument("--skip-failed", action="store_true",
                   help="leave failed runs alone (by default a rerun resumes or restarts them, as it does interrupted "
                        "ones; only completed and diverged runs are results)")
    p.add_argument("--retry-failed", action="store_true", help=argparse.SUPPRESS)  # the default now; old scripts
    p.add_argument("--nodes", type=int, help="--slurm/--torchrun: nodes per run (default: the grid's, else 1)")
    p.add_argument("--gpus-per-node", type=int,
                   help="--slurm/--torchrun: GPUs per node (default: grid's, else 8); 0: a CPU job, one task per node")
    p.add_argument("--cpus-per-task", type=int, help="--slurm: CPUs per task (default: the grid's, else 12)")
    p.add_argument("--time", help="--slurm: time limit per element, as sbatch takes it (default: the grid's)")
    p.add_argument("--partition", help="--slurm: partition (default: the grid's, else the cluster's default)")
    p.add_argument("--no-validate", action="store_true", help="skip checking the runs against lnstab fit's parser")
    return p


def parse_sets(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings as overrides (values read as YAML)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise LNStabError(f"--set {item!r} is not allowed; give KEY=VALUE, e.g. --set trainer.max_steps=100")
        check_yaml_text(value, f"--set {key}")  # bounded: the value is parsed, then written into every run's command
        out[key] = yaml.safe_load(value) if value else ""
    return out


def select(grid: Grid, patterns: list[str] | None) -> list[Run]:
    """The runs named by ``patterns`` (all when ``None``), in grid order."""
    if not patterns:
        return list(grid.runs)
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(r.name, pattern) for r in grid.runs):
            raise GridError(f"grid {grid.path}: --only {pattern!r} is not allowed; it matches no run (see --dry-run)")
    return [r for r in grid.runs if any(fnmatch.fnmatchcase(r.name, p) for p in patterns)]


def with_sets(grid: Grid, sets: dict[str, Any]) -> Grid:
    """``grid`` with ``sets`` added to every run; a key the grid varies (an axis or an ``include``) is refused."""
    if not sets:
        return grid
    varying = {k for r in grid.runs for k in r.overrides} - set(grid.overrides)
    for key in sets:
        check_key(f"grid {grid.path}", "--set", key)
        if key in varying:
            raise GridError(f"grid {grid.path}: --set {key} is not allowed; the grid varies it across runs")
    runs = [Run(r.name, {**r.overrides, **sets}, r.point) for r in grid.runs]
    return dataclasses.replace(grid, runs=runs, overrides={**grid.overrides, **sets})


def validate_with_cli(grid: Grid, runs: list[Run], local: bool = False) -> None:
    """Parse runs as ``lnstab fit --config BASE <overrides> --print_config`` does (every key must exist and every
    value have the right type), then check the printed config's values as ``lnstab fit`` does before it builds
    anything (:func:`lnstab.lightning_cli.check_fit_config`). Each key/value pair is parsed in at least one run (a
    covering set: a parse is about 0.25 s); every other run's *combination* is then checked on the config of a parsed
    run that sets the same keys, with its values as the parses typed them (``model.n_embd`` 64 with ``model.n_head``
    3 is refused even where each value was parsed in a valid run); a run that cannot be placed so is parsed itself.

    Raises:
        GridError: One line naming the grid, the run and what ``lnstab fit`` refused.
    """
    from lnstab.cli import cli_main
    from lnstab.lightning_cli import check_fit_config

    pairs = {run.name: {(k, repr(v)) for k, v in run.overrides.items()} for run in runs}
    uncovered = set().union(*pairs.values()) if pairs else set()
    covering: list[Run] = runs[:1]
    uncovered -= pairs[runs[0].name] if runs else set()
    while uncovered:  # greedy: the run that checks the most unchecked key/value pairs
        best = max(runs, key=lambda r: len(pairs[r.name] & uncovered))
        covering.append(best)
        uncovered -= pairs[best.name]

    def parsed(run: Run) -> Any:
        """The config ``lnstab fit`` prints for ``run``, checked as it checks it."""
        args = ["fit", "--config", str(grid.base), *run.cli_args(), "--print_config"]
        out, err = io.StringIO(), io.StringIO()
        code: Any = 0
        config = None
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli_main(args)
            except SystemExit as exc:
                code = exc.code
            except LNStabError as exc:
                code, err = 2, io.StringIO(f"lnstab: error: {exc}")
        if code in (0, None):  # parsed; the values lnstab fit refuses before it builds anything
            try:
                config = yaml.safe_load(out.getvalue())
                check_fit_config(config)
            except LNStabError as exc:
                code, err = 2, io.StringIO(f"lnstab: error: {exc}")
        if code not in (0, None):
            refuse(run, " ".join(err.getvalue().split()).removeprefix("lnstab: error: ").split(" (see: ")[0]
                   or f"lnstab fit exited with {code}")
        return config

    def refuse(run: Run, message: str) -> None:
        raise GridError(f"grid {grid.path}: run {run.name!r}: lnstab fit refuses it: {message}")

    typed: dict[tuple[str, str], Any] = {}  # a key/value pair as a parse typed it
    by_keys: dict[frozenset[str], Any] = {}  # a parsed config of a run that sets these keys
    configs: dict[str, Any] = {}  # every run's config, as lnstab fit would read it
    for run in covering:
        config = configs[run.name] = parsed(run)
        by_keys.setdefault(frozenset(run.overrides), config)
        for key, value in run.overrides.items():
            if (spot := _config_spot(config, key)) is not None:
                typed[(key, repr(value))] = spot[0][spot[1]]
    for run in runs:
        if run in covering:
            continue
        if frozenset(run.overrides) not in by_keys:  # an include or compound value with keys of its own
            configs[run.name] = parsed(run)
            continue
        config = copy.deepcopy(by_keys[frozenset(run.overrides)])
        for key, value in run.overrides.items():
            spot = _config_spot(config, key)
            if spot is None or (key, repr(value)) not in typed:
                config = parsed(run)  # a key this cannot place (a class_path): the whole parse
                break
            spot[0][spot[1]] = copy.deepcopy(typed[(key, repr(value))])
        else:
            try:
                check_fit_config(config)
            except LNStabError as exc:
                refuse(run, str(exc))
        configs[run.name] = config
    if local:  # the runs start here: data a run would not find fails it in its first seconds, every run alike
        _check_local_data(grid, runs, configs)


def _check_local_data(grid: Grid, runs: list[Run], configs: dict[str, Any]) -> None:
    """Refuse, in one line naming the grid, a run and how many runs share it, a text ``--data.path`` that names
    nothing here (a local sweep's runs would each fail on it in turn, after seconds of start-up)."""
    from lnstab.datamodules.text import DataError, resolve_files

    paths: dict[str, list[str]] = {}
    for run in runs:
        data = (configs.get(run.name) or {}).get("data") or {}
        args = data.get("init_args") or {}
        if args.get("source") in ("files", "auto") and args.get("path"):
            paths.setdefault(str(args["path"]), []).append(run.name)
    for path, names in paths.items():
        try:
            resolve_files(path)
        except DataError as exc:
            raise GridError(f"grid {grid.path}: run {names[0]!r}"
                            + (f" and {len(names) - 1} more" if len(names) > 1 else "")
                            + f": {exc} (from here, where the sweep runs them)") from None


_PLACED = ("class_path", "init_args", "dict_kwargs")  # keys whose value changes what else the config holds


def _config_spot(config: Any, key: str) -> tuple[dict[str, Any], str] | None:
    """Where a dotted override key sits in a printed config (``data.batch_size`` in ``data.init_args``): the
    mapping and its key, or ``None`` where it does not sit there plainly."""
    *path, last = key.split(".")
    if last in _PLACED or any(part in _PLACED[:1] for part in path):
        return None
    node = config
    for part in path:
        if not isinstance(node, dict):
            return None
        node = node[part] if part in node else (node.get("init_args") or {}).get(part)
    if not isinstance(node, dict):
        return None
    if last not in node and isinstance(node.get("init_args"), dict):
        node = node["init_args"]
    return (node, last) if last in node else None


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """``rows`` as left-aligned text columns."""
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) if rows else len(c) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(str(row[c]).ljust(widths[c]) for c in columns))


def show_status(grid: Grid, runs: list[Run], root: str) -> None:
    """Print the ``--status`` table and a one-line count; a run with a damaged ``summary.json`` shows as
    ``damaged`` and is named with its problem under the table (the other runs are shown as usual)."""
    from lnstab.rundir import RunFileError

    rows, damaged = [], []
    known = launched(root, grid)  # once, not once a run
    for run in runs:
        try:
            rows += status_rows(grid, [run], root, known)
        except RunFileError as exc:
            rows.append({"run": run.name, "status": "damaged", "step": None, "val_loss": None, "wall": None,
                         "next": "skip"})
            damaged.append(f"{run.name}: {exc}")
    for row in rows:
        row["step"] = "-" if row["step"] is None else row["step"]
        row["val_loss"] = f"{row['val_loss']:.4f}" if is_number(row["val_loss"]) else "-"
        row["wall"] = format_duration(row["wall"] if is_number(row["wall"]) else None)
    print_table(rows, ["run", "status", "step", "val_loss", "wall", "next"])
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    total = sum(r for r in (s.get("wall_s") for s in _summaries(grid, runs, root)) if is_number(r))
    print(f"{len(rows)} runs: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
          + f"; wall time so far {format_duration(total)}")
    if any(row["next"].endswith("*") for row in rows):
        print("* running, but no sweep on this machine holds it: killed (a rerun resumes it), or training elsewhere")
    for line in damaged:
        print(f"damaged: {line}")


def _summaries(grid: Grid, runs: list[Run], root: str) -> list[dict[str, Any]]:
    from lnstab.rundir import RunFileError, read_summary

    out = []
    for run in runs:
        try:
            out.append(read_summary(run_directory(root, grid, run)))
        except RunFileError:
            out.append({})  # named by show_status
    return out


def prepare(grid: Grid, run: Run, root: str, retry_failed: bool = True) -> str:
    """Settle one run before a job launches it: ``skip``, ``resume`` or ``start`` (moving aside a dead start)."""
    record_manifest(root, grid, grid.runs)
    p = plan(run_directory(root, grid, run), retry_failed=retry_failed)
    if p.action == "restart":
        moved = move_aside(root, grid, run)
        print(f"lnstab sweep: {run.name}: {p.status} with no checkpoint; moved to {moved}", file=sys.stderr)
    action = "start" if p.action == "restart" else p.action
    journal(root, grid, run=run.name, action=f"prepare:{action}", status=p.status)
    return action


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``lnstab sweep`` (``argv`` without the subcommand)."""
    args = build_parser().parse_args(argv)
    if args.parallel < 1:
        raise LNStabError(f"--parallel {args.parallel} is not allowed; it must be an integer >= 1")
    grid = with_sets(load_grid(args.grid), parse_sets(args.set))
    runs = select(grid, args.only)
    if args.status:
        show_status(grid, runs, args.root)
        return
    if not args.dry_run:
        check_sweep_dirs(args.root, grid)  # a file where a directory of the sweep goes: one line, nothing written
    if args.prepare:
        print(prepare(grid, grid.run(args.prepare), args.root, not args.skip_failed))
        return
    if args.slurm or args.torchrun:
        settings = slurm_settings(grid, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                                  cpus_per_task=args.cpus_per_task, time=args.time, partition=args.partition)
        if not args.no_validate:
            validate_with_cli(grid, runs)
        check_manifest(args.root, grid, runs)  # else every element of the job is refused as it starts
        repeat = [f"--set={item}" for item in args.set] + (["--skip-failed"] if args.skip_failed else [])
        if args.slurm:
            with writing(sweep_dir(args.root, grid) / "slurm"):
                (sweep_dir(args.root, grid) / "slurm").mkdir(parents=True, exist_ok=True)  # sbatch's --output
            sys.stdout.write(sbatch_script(grid, runs, args.root, settings, args.grid, repeat))
        else:
            sys.stdout.write(torchrun_commands(grid, runs, args.root, settings, args.grid, repeat))
        return
    if not args.no_validate:
        validate_with_cli(grid, runs, local=True)
    if args.dry_run:
        check_manifest(args.root, grid, runs)  # as the sweep itself would refuse them
        print(f"grid {grid.name} ({grid.path}): {len(runs)} run(s) of {grid.base} -> {Path(args.root) / grid.name}/")
        if grid.overrides:
            print("every run: " + " ".join(Run("", grid.overrides).cli_args()))
        for run in runs:
            own = {k: v for k, v in run.overrides.items() if k not in grid.overrides}
            print(f"{run.name}: {' '.join(Run(run.name, own).cli_args())}")
        if runs:
            print("command: " + shlex.join(fit_command(grid, runs[0], args.root)))
        return
    code = LocalSweep(grid, runs, args.root, parallel=args.parallel, retry_failed=not args.skip_failed).run()
    if code:
        raise SystemExit(code)
