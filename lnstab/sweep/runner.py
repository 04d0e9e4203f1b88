"""Running a grid's runs on this machine: each a plain ``lnstab fit`` child process, one after another or N at once.

A run that fails or diverges is recorded (journal, its own ``summary.json``) and the sweep goes on. A first SIGINT or
SIGTERM stops launching and passes one SIGTERM to every child, which saves ``last.ckpt`` at its next optimizer step
and ends ``interrupted`` (resumed by the next sweep); a second one kills the children. A sweep that is killed
outright takes its children with it the same way (:func:`lnstab.parentdeath.follow_parent`).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lnstab.errors import LNStabError, first_line, one_line
from lnstab.parentdeath import PARENT_ENV
from lnstab.rundir import read_summary
from lnstab.sweep.grid import Grid, Run, cli_value
from lnstab.sweep.state import (
    DONE,
    changed_keys,
    journal,
    launched,
    move_aside,
    plan,
    record_manifest,
    run_directory,
    run_lock,
    sweep_dir,
    write_log_header,
)

RESUME_ARGS = ("--ckpt_path", "last")  # resume the run's newest complete checkpoint, strictly


def fit_command(grid: Grid, run: Run, root: str | Path, *, resume: bool = False,
                extra: dict[str, Any] | None = None, program: tuple[str, ...] = ("lnstab",)) -> list[str]:
    """The ``lnstab fit`` command of one run: the grid's base experiment, the run's directory, its overrides.

    Args:
        grid: The grid.
        run: The run.
        root: Directory holding the grids' run directories (``runs``).
        resume: Resume from the run's newest checkpoint (``--ckpt_path last``).
        extra: Further ``key: value`` overrides (e.g. ``trainer.num_nodes`` on a cluster).
        program: How to call lnstab (``("lnstab",)``, or this interpreter's ``-m lnstab.cli``).
    """
    cmd = [*program, "fit", "--config", str(grid.base), "--run_dir", str(run_directory(root, grid, run))]
    if resume:
        cmd += list(RESUME_ARGS)
    cmd += run.cli_args()
    for key, value in (extra or {}).items():
        cmd += [f"--{key}", cli_value(value)]
    return cmd


def lnstab_program() -> tuple[str, ...]:
    """The ``lnstab`` console script of this interpreter's environment, else ``python -m lnstab.cli``."""
    script = Path(sys.executable).with_name("lnstab")
    if script.is_file() and os.access(script, os.X_OK):
        return (str(script),)
    found = shutil.which("lnstab")
    return (found,) if found else (sys.executable, "-m", "lnstab.cli")


def format_duration(seconds: float | None) -> str:
    """``1h02m``, ``3m05s``, ``12s``; ``-`` when unknown."""
    if seconds is None or not isinstance(seconds, int | float) or not math.isfinite(seconds):
        return "-"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class LocalSweep:
    """Runs a grid's runs as ``lnstab fit`` child processes on this machine.

    Args:
        grid: The grid.
        runs: The runs to consider (a subset of ``grid.runs``), in order.
        root: Directory holding the grids' run directories.
        parallel: Child processes at a time.
        retry_failed: Run ``failed`` runs again (resume or restart); ``False`` skips them (``--skip-failed``).
        extra: Overrides added to every run (``--set``).
        echo: Where progress lines go.
    """

    def __init__(self, grid: Grid, runs: list[Run], root: str | Path, *, parallel: int = 1,
                 retry_failed: bool = True, extra: dict[str, Any] | None = None,
                 echo: Callable[[str], None] = print) -> None:
        self.grid, self.runs, self.root = grid, runs, Path(root)
        self.parallel, self.retry_failed, self.extra = parallel, retry_failed, dict(extra or {})
        self.echo = echo
        self.stopping = threading.Event()
        self.children: dict[str, subprocess.Popen] = {}
        self._lock = threading.Lock()
        self._signals = 0
        self._signal_number = 0
        self.results: dict[str, dict[str, Any]] = {}

    def run(self) -> int:
        """Run every run that needs it; returns 0 when all ended completed or diverged (or were skipped as such),
        1 when some failed or are damaged, ``128 + signal`` when a signal stopped the sweep."""
        record_manifest(self.root, self.grid, self.grid.runs)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            with cf.ThreadPoolExecutor(max_workers=self.parallel) as pool:
                futures = [pool.submit(self._one, i, run) for i, run in enumerate(self.runs)]
                for run, future in zip(self.runs, futures, strict=True):
                    while True:  # wait in slices so the main thread can take signals
                        try:
                            future.result(timeout=0.5)
                            break
                        except cf.TimeoutError:
                            continue
                        except Exception as exc:  # noqa: BLE001 - one run's trouble must not end the sweep
                            self.results[run.name] = {"status": "failed"}
                            why = one_line(exc) if isinstance(exc, LNStabError) else f"{type(exc).__name__}: {exc}"
                            self.echo(f"{run.name}: the sweep could not run it: {why}")
                            break
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if self._signals:
            return 128 + int(self._signal_number)
        failed = [n for n, r in self.results.items() if r["status"] not in (*DONE, "skipped")]
        return 1 if failed else 0

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals += 1
        self._signal_number = signum
        self.stopping.set()
        with self._lock:
            children = list(self.children.items())
        kind = signal.SIGTERM if self._signals == 1 else signal.SIGKILL
        self.echo(f"sweep: {signal.Signals(signum).name}: no new runs; sending {kind.name} to "
                  f"{len(children)} running run(s)" + (" (they save last.ckpt and stop)" if self._signals == 1 else ""))
        for _, child in children:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(kind)

    def _one(self, index: int, run: Run) -> None:
        head = f"[{index + 1}/{len(self.runs)}] {run.name}"
        if self.stopping.is_set():
            self.results[run.name] = {"status": "not started"}
            return
        directory = run_directory(self.root, self.grid, run)
        with run_lock(self.root, self.grid, run) as fd:
            p = plan(directory, locked=fd is None, retry_failed=self.retry_failed)
            if p.action == "skip":
                self.echo(f"{head}: {p.status}, skipped ({p.reason})")
                # a damaged run is skipped but not quietly: the sweep then exits 1, like a failed run
                self.results[run.name] = {"status": p.status if p.status in (*DONE, "damaged") else "skipped"}
                journal(self.root, self.grid, run=run.name, action="skip", status=p.status)
                return
            if p.action == "restart":
                moved = move_aside(self.root, self.grid, run)
                self.echo(f"{head}: {p.status} with no checkpoint; moved to {moved}")
            cmd = fit_command(self.grid, run, self.root, resume=p.action == "resume", extra=self.extra,
                              program=lnstab_program())
            log = sweep_dir(self.root, self.grid) / "logs" / f"{run.name}.log"
            write_log_header(log, f"{p.action}: {' '.join(cmd)}")
            self.echo(f"{head}: {p.action} (log: {log})")
            started = time.monotonic()
            with open(log, "a", encoding="utf-8") as out:
                env = {**os.environ, PARENT_ENV: str(os.getpid())}  # the child ends with this sweep
                child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         pass_fds=(fd,), start_new_session=True, env=env)
                with self._lock:
                    self.children[run.name] = child
                if self.stopping.is_set():  # a signal came between the check above and the start
                    with contextlib.suppress(ProcessLookupError):
                        child.send_signal(signal.SIGTERM)
                code = child.wait()
                with self._lock:
                    self.children.pop(run.name, None)
        wall = time.monotonic() - started
        summary = read_summary(directory)
        status = summary.get("status") or "failed"
        ended_by_us = self.stopping.is_set() and code in (-signal.SIGTERM, -signal.SIGKILL)
        if status in ("running", "failed") and not summary.get("error") and ended_by_us:
            # this sweep's own signal ended a child that had not yet taken it over (in its first seconds): not a
            # failure of the run; the next sweep starts or resumes it
            status = "not started" if not summary else "interrupted"
        elif status == "running":  # the child died without ending its run (killed outright, out of memory, …)
            status = "failed"
        self.results[run.name] = {"status": status, "returncode": code}
        journal(self.root, self.grid, run=run.name, action=p.action, returncode=code, status=status,
                step=summary.get("final_step"), wall_s=round(wall, 1), log=str(log))
        self.echo(f"{head}: {describe(summary, status, code, log)} in {format_duration(wall)}")


def describe(summary: dict[str, Any], status: str, code: int | None = None, log: Path | None = None) -> str:
    """One phrase for how a run ended: ``completed at step 600 (val loss 5.12)``, ``diverged at step 35``, …"""
    val = (summary.get("val") or {}).get("loss")
    loss = f" (val loss {val:.4g})" if isinstance(val, int | float) else ""
    if status == "diverged":
        return f"diverged at step {summary.get('diverged_step')}{loss}"
    if status == "failed":
        error = summary.get("error") or _last_line(log) or "see its log"
        return f"failed (exit {code}): {first_line(error)[:200]}"
    if status == "not started":
        return f"stopped by the sweep's signal before it began (exit {code})"
    step = summary.get("final_step", summary.get("interrupted_step"))
    return f"{status} at step {step}{loss}" + (f" (exit {code})" if code not in (0, None) else "")


def _last_line(log: Path | None) -> str:
    """The last non-empty line of a log (where ``lnstab fit`` put its one-line error)."""
    if log is None or not log.is_file():
        return ""
    lines = [x for x in log.read_text(encoding="utf-8", errors="replace").splitlines() if x.strip()]
    return lines[-1].strip() if lines else ""


def status_rows(grid: Grid, runs: list[Run], root: str | Path,
                known: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per run for ``--status``: name, status, step, val loss, wall time, what a rerun would do
    (``known``: the manifest's runs, :func:`~lnstab.sweep.state.launched`, read here when not given)."""
    from lnstab.sweep.state import is_locked

    known = launched(root, grid) if known is None else known
    rows = []
    for run in runs:
        directory = run_directory(root, grid, run)
        p = plan(directory, locked=is_locked(root, grid, run))
        summary = read_summary(directory) if directory.is_dir() else {}
        step = summary.get("final_step", summary.get("interrupted_step", (summary.get("val") or {}).get("step")))
        if p.status == "diverged":
            step = summary.get("diverged_step", step)
        val = (summary.get("val") or {}).get("loss")
        action = p.action + ("*" if p.status == "running" and p.action != "skip" else "")
        if changed := changed_keys(known, run):  # the sweep refuses it: its directory is another run's
            action = f"refuse (launched with other {', '.join(changed)})"
        rows.append({"run": run.name, "status": p.status, "step": step, "val_loss": val,
                     "wall": summary.get("wall_s"), "next": action})
    return rows
