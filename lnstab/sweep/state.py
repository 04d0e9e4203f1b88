"""Where a sweep keeps its runs and its own records, and what a rerun does with each run.

``<root>/<grid>/<run>/`` is a plain ``lnstab fit`` run directory (:mod:`lnstab.rundir`). Beside the runs, the sweep
keeps its own records in ``<root>/<grid>/.sweep/`` (hidden, so reports and TensorBoard skip it)::

    manifest.json           {"grid", "base", "runs": [{"name", "overrides"}, …]}: what each run name means, in
                            the grid's order (reports list runs, and count the ones not started, from it)
    journal.jsonl           one line per launch: run, action, exit code, status, wall time, log
    logs/<run>.log          the output of every attempt of the run (appended)
    locks/<run>.lock        held (flock) by the sweep and its child while the run trains
    attempts/<run>.<k>/     a run killed before its first checkpoint, moved aside before it starts again

A rerun decides per run (:func:`plan`): ``completed`` and ``diverged`` runs are results and are skipped, and only
they (``--skip-failed`` leaves ``failed`` runs alone too: on a cluster a failure is as often the node's as the
run's); a run with a complete checkpoint resumes from it; one without (killed before its
first checkpoint) is moved aside and starts again; a run whose lock is held is running and is left alone; a run
whose ``summary.json`` is damaged is ``damaged`` and left alone (its state is unknown), named with the problem.

A damaged manifest is refused in one line naming it (:class:`~lnstab.rundir.RunFileError`): it is what guards a
run name against a changed meaning, so a sweep does not guess past it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lnstab.errors import ConfigError, writing
from lnstab.rundir import (
    SUMMARY_FILE,
    RunFileError,
    atomic_write_text,
    decode_float,
    json_safe,
    read_object,
    read_summary,
    write_json,
)
from lnstab.sweep.grid import Grid, GridError, Run, check_run_name

SWEEP_DIR = ".sweep"
DONE = ("completed", "diverged")
# Seconds a sweep waits for the lock of a run that has just recorded its end (its process is exiting).
ENDING_GRACE_S = 30.0


def grid_dir(root: str | Path, grid: Grid) -> Path:
    """``<root>/<grid name>``."""
    return Path(root) / grid.name


def run_directory(root: str | Path, grid: Grid, run: Run) -> Path:
    """``<root>/<grid name>/<run name>``."""
    return grid_dir(root, grid) / run.name


def sweep_dir(root: str | Path, grid: Grid) -> Path:
    """The sweep's own records, ``<root>/<grid name>/.sweep``."""
    return grid_dir(root, grid) / SWEEP_DIR


# the directories a sweep makes in .sweep, and what each holds
SWEEP_SUBDIRS = {"locks": "run locks", "logs": "run logs", "attempts": "moved-aside attempts", "slurm": "job logs"}


def check_sweep_dirs(root: str | Path, grid: Grid) -> None:
    """Refuse, before anything is written, a ``--root``, grid directory or ``.sweep`` (or a directory in it) that
    is something other than a directory: a file there would otherwise end a sweep in a traceback half-way.

    Raises:
        ConfigError: One line naming the path, what it is and what a sweep keeps there.
    """
    records = sweep_dir(root, grid)
    expected = [(Path(root), "grids' runs"), (grid_dir(root, grid), "runs"), (records, "own records"),
                *((records / name, role) for name, role in SWEEP_SUBDIRS.items())]
    for path, role in expected:
        if os.path.lexists(path) and not path.is_dir():
            what = "a symbolic link to nothing" if path.is_symlink() and not path.exists() else "a file"
            raise ConfigError(f"{path} is {what}, not a directory; lnstab sweep keeps its {role} in a directory "
                              "there: move it away, or choose another --root")


@dataclass(frozen=True)
class Plan:
    """What the state of a run directory is, and what running the sweep again does with it."""

    status: str  # pending | running | completed | diverged | interrupted | failed | unknown | damaged
    action: str  # start | resume | restart | skip
    reason: str = ""


def plan(directory: Path, *, locked: bool = False, retry_failed: bool = True) -> Plan:
    """The :class:`Plan` for the run in ``directory`` (``locked``: another process holds its lock)."""
    if locked:  # checked first: a run just launched may not have written its directory yet
        return Plan("running", "skip", "its lock is held by another sweep")
    if not directory.exists() or not any(directory.iterdir()):
        return Plan("pending", "start")
    try:
        summary = read_summary(directory) if (directory / SUMMARY_FILE).is_file() else {}
    except RunFileError as exc:
        return Plan("damaged", "skip", f"{exc}; repair it or move the run away")
    status = summary.get("status") or "unknown"
    if status in DONE:
        return Plan(status, "skip", "a result")
    if status == "failed" and not retry_failed:
        return Plan(status, "skip", "failed (--skip-failed)")
    from lnstab.checkpoint import newest_checkpoint  # imports torch: only when a run may resume

    stale = "no local sweep holds it: killed, or running on another machine" if status == "running" else ""
    if newest_checkpoint(directory) is not None:
        return Plan(status, "resume", stale)
    return Plan(status, "restart", stale or "no checkpoint to resume: the old directory is moved aside")


def move_aside(root: str | Path, grid: Grid, run: Run) -> Path:
    """Move a run directory that cannot be resumed to ``.sweep/attempts/<run>.<k>``; returns where it went."""
    attempts = sweep_dir(root, grid) / "attempts"
    with writing(attempts):
        attempts.mkdir(parents=True, exist_ok=True)
        k = 1
        while (attempts / f"{run.name}.{k}").exists():
            k += 1
        target = attempts / f"{run.name}.{k}"
        os.replace(run_directory(root, grid, run), target)
    return target


def record_manifest(root: str | Path, grid: Grid, runs: list[Run]) -> None:
    """Add ``runs`` (all of the grid's, so a report counts the ones not started) to the grid's manifest, refusing a
    run name that already means other overrides.

    Raises:
        GridError: A run of this name was launched before with different overrides (the grid changed under the
            same names); nothing is written.
    """
    path = sweep_dir(root, grid) / "manifest.json"
    base = str(Path(grid.base).resolve())
    manifest = read_manifest(grid_dir(root, grid)) or {"grid": str(Path(grid.path).resolve()), "base": base, "runs": []}
    known = dict(manifest_runs(manifest))
    _refuse_changed(root, grid, known, runs)
    if base != manifest.get("base") and known:
        raise GridError(f"grid {grid.path}: base {base} is not allowed; the runs in {grid_dir(root, grid)} were "
                        f"launched from base {manifest.get('base')}")
    names = {r.name for r in runs}
    manifest["runs"] = [{"name": r.name, "overrides": _jsonable(r.overrides)} for r in runs] + [
        {"name": n, "overrides": o} for n, o in known.items() if n not in names]
    write_json(path, manifest)


def changed_keys(known: dict[str, dict[str, Any]], run: Run) -> list[str]:
    """The override keys in which ``run`` differs from the run of its name in a manifest (``known``: name →
    overrides; ``[]`` where it is not there or the same)."""
    before = known.get(run.name)
    if before is None or _canonical(before) == _canonical(run.overrides):
        return []
    return sorted(k for k in set(before) | set(run.overrides)
                  if _canonical(before.get(k)) != _canonical(run.overrides.get(k)))


def _refuse_changed(root: str | Path, grid: Grid, known: dict[str, dict[str, Any]], runs: list[Run]) -> None:
    for run in runs:
        if changed := changed_keys(known, run):
            raise GridError(
                f"grid {grid.path}: run {run.name!r} in {grid_dir(root, grid)} was launched with other overrides "
                f"(differs in {', '.join(changed)}); use another --root or grid name, or move the old runs away"
            )


def check_manifest(root: str | Path, grid: Grid, runs: list[Run]) -> None:
    """What :func:`record_manifest` would refuse, refused without writing (``--dry-run``, ``--slurm``: before the
    job's every element is refused as it starts).

    Raises:
        GridError: As :func:`record_manifest`.
    """
    _refuse_changed(root, grid, launched(root, grid), runs)


def launched(root: str | Path, grid: Grid) -> dict[str, dict[str, Any]]:
    """The runs the grid's manifest records, name → overrides (none where there is no manifest, or a damaged one:
    the sweep says so itself, in its own words, when it runs)."""
    try:
        manifest = read_manifest(grid_dir(root, grid))
    except RunFileError:
        return {}
    return dict(manifest_runs(manifest)) if manifest else {}


def read_manifest(grid_directory: str | Path) -> dict[str, Any] | None:
    """The manifest of a sweep's grid directory (``None`` when the directory was not made by a sweep).

    Raises:
        RunFileError: The manifest is damaged: not JSON, or not ``{"runs": [{"name", "overrides"}, …]}`` with run
            names that stay inside the grid's directory.
    """
    path = Path(grid_directory) / SWEEP_DIR / "manifest.json"
    manifest = read_object(path, "a sweep manifest (an object)")
    if manifest is None:
        return None
    entries = manifest.get("runs", [])
    if not isinstance(entries, list):
        raise RunFileError(path, "'runs' is not a list")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("overrides", {}), dict):
            raise RunFileError(path, f"runs[{i}] is not {{\"name\": …, \"overrides\": {{…}}}}")
        try:
            check_run_name(str(path), entry.get("name"))
        except GridError:
            raise RunFileError(path, f"runs[{i}] has the name {entry.get('name')!r}, which is not a run name "
                                     f"(it must stay a directory inside the grid's directory)") from None
    return manifest


def manifest_runs(manifest: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``[(run name, overrides), …]`` of a manifest, in the grid's order."""
    return [(e["name"], e.get("overrides") or {}) for e in manifest.get("runs") or [] if isinstance(e, dict)]


def _canonical(obj: Any) -> str:
    """``obj`` as the JSON the manifest stores, keys sorted: equal text, equal overrides (NaN equals NaN)."""
    return json.dumps(json_safe(obj), sort_keys=True, default=str, allow_nan=False)


def _jsonable(obj: Any) -> Any:
    return json.loads(_canonical(obj), object_hook=decode_float)


def journal(root: str | Path, grid: Grid, **entry: Any) -> None:
    """Append one record to the sweep's journal (``time`` added)."""
    path = sweep_dir(root, grid) / "journal.jsonl"
    entry = {"time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **entry}
    with writing(path):  # a full disk: one line naming the journal and the OS's reason
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, default=str) + "\n")


def read_journal(root: str | Path, grid: Grid) -> list[dict[str, Any]]:
    """The journal's records, oldest first."""
    path = sweep_dir(root, grid) / "journal.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def lock_path(root: str | Path, grid: Grid, run: Run) -> Path:
    """``.sweep/locks/<run>.lock``."""
    return sweep_dir(root, grid) / "locks" / f"{run.name}.lock"


@contextlib.contextmanager
def run_lock(root: str | Path, grid: Grid, run: Run, *, wait_ending: bool = True) -> Iterator[int | None]:
    """Hold the run's lock: yields its file descriptor (pass it to the child so the lock outlives this process
    while the child trains), or ``None`` when another process holds it.

    A run whose summary records its end (``interrupted``, ``completed`` … in the last :data:`ENDING_GRACE_S`
    seconds) is held by a process that is exiting: the lock is waited for, up to that long, rather than the run
    reported as running (a sweep killed outright and rerun at once would otherwise skip the run its orphan has just
    saved; ``lnstab sweep`` starts in about a second, quicker than a trained process exits). ``wait_ending=False``
    answers at once.
    """
    path = lock_path(root, grid, run)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + ENDING_GRACE_S
        while not _try_lock(fd):
            if not wait_ending or time.monotonic() > deadline or not _ending(run_directory(root, grid, run)):
                yield None
                return
            time.sleep(0.2)
        try:
            yield fd
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _ending(directory: Path) -> bool:
    """Whether the run in ``directory`` recorded its end within the last :data:`ENDING_GRACE_S` seconds."""
    try:
        summary = read_summary(directory) if (directory / SUMMARY_FILE).is_file() else {}
        ended = dt.datetime.fromisoformat(summary["ended_at"])
    except (RunFileError, KeyError, TypeError, ValueError):
        return False
    age = (dt.datetime.now(dt.timezone.utc) - ended).total_seconds()
    return summary.get("status") not in (None, "running") and 0 <= age < ENDING_GRACE_S


def is_locked(root: str | Path, grid: Grid, run: Run) -> bool:
    """Whether some process holds the run's lock (it is training under a local sweep)."""
    path = lock_path(root, grid, run)
    if not path.is_file():
        return False
    with run_lock(root, grid, run, wait_ending=False) as fd:
        return fd is None


def write_log_header(path: Path, text: str) -> None:
    """Start an attempt's section in a run's log file."""
    with writing(path):  # a full disk: one line naming the log and the OS's reason
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            atomic_write_text(path, "")
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"\n===== {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')} {text}\n")
