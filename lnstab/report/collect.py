"""Reading run directories back: config, summary, final evaluation, hidden-state series, TensorBoard scalars.

Everything comes from the files a run wrote (:mod:`lnstab.rundir`); nothing is recomputed by running a model.
TensorBoard scalars are read with TensorBoard's own ``EventAccumulator``; when a run was resumed, a step written
again (the replayed steps after the checkpoint) keeps its latest value.

A path given to :func:`collect` is a run directory, or a directory of run directories (a sweep's grid directory,
``runs/<experiment>``). For a sweep's grid directory the runs its manifest lists that have no directory yet are
reported as ``missing``, so they show in the tables' counts instead of vanishing. A run with a damaged file
(a truncated ``summary.json``, ``eval.json`` or ``hidden_stats.json``, a half-written line of
``divergence_events.jsonl``, a ``config.yaml`` that is not YAML, a value of a kind lnstab never writes there, a
TensorBoard event file that is empty, cut short or not one) is reported the same way, as ``damaged``: named with its
file and problem in one line, counted in the tables' ``n``, none of its data used; a damaged manifest is named in one
line and left out (its missing runs are then not counted).
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lnstab import runlock
from lnstab.errors import LNStabError
from lnstab.moduleargs import argument_type
from lnstab.rundir import (
    CONFIG_FILE,
    RunFileError,
    fit_eval,
    is_run_dir,
    read_events,
    read_hidden_series,
    read_summary,
    shown,
)
from lnstab.safeload import DataFileError, load_yaml
from lnstab.sweep.state import manifest_runs, read_manifest
from lnstab.validation import is_integer, is_number

# Config keys that say where a run ran or how often it was measured and saved, not what it is: not part of a
# configuration (two runs that differ only in how often a probe ran are the same configuration).
IGNORED_PREFIXES = (
    "trainer.logger", "trainer.default_root_dir", "run_dir", "ckpt_path", "extends", "instruments.", "checkpoint.",
    "trainer.callbacks", "trainer.enable_progress_bar", "trainer.log_every_n_steps",
)
# The sections of a config lnstab fit saves as mappings (or null).
CONFIG_GROUPS = ("trainer", "model", "data", "checkpoint", "evaluation", "instruments", "optimizer", "lr_scheduler")
EVENT_FILES = "events.out.tfevents.*"


class ReportError(LNStabError):
    """A path that is not an lnstab run directory or a directory of them."""


@dataclass
class RunRecord:
    """What one run left on disk (``status`` ``missing``: a sweep planned it and no directory exists; ``damaged``:
    one of its files is damaged, named in ``problem``, and none of its data is used)."""

    name: str
    path: Path
    status: str
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    hidden: dict[str, Any] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    problem: str | None = None
    _scalars: dict[str, list[tuple[int, float]]] | None = None

    @property
    def diverged_step(self) -> int | None:
        """The step of the first fatal divergence (summary, else the first non-finite event), ``None`` if none."""
        step = _step(self.summary.get("diverged_step"))
        if step is None and self.status == "diverged":
            fatal = [s for e in self.events if str(e.get("kind", "")).startswith("nonfinite")
                     if (s := _step(e.get("step"))) is not None]
            step = min(fatal) if fatal else None
        return step

    def scalars(self) -> dict[str, list[tuple[int, float]]]:
        """Every TensorBoard scalar of the run: ``{tag: [(step, value), …]}`` in step order (read once)."""
        if self._scalars is None:
            self._scalars = read_scalars(self.path) if self.path.is_dir() else {}
        return self._scalars

    def series(self, tag: str) -> list[tuple[int, float]]:
        """One scalar's ``[(step, value), …]`` (``[]`` when the run did not log it)."""
        return self.scalars().get(tag, [])


def read_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """The TensorBoard scalars of a run directory; a step written twice keeps its later value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not any(directory.glob(EVENT_FILES)):
        return {}
    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0}, purge_orphaned_data=False)
    acc.Reload()
    out = {}
    for tag in acc.Tags().get("scalars", []):
        by_step: dict[int, float] = {}
        for event in acc.Scalars(tag):
            by_step[int(event.step)] = float(event.value)
        out[tag] = sorted(by_step.items())
    return out


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``{"a.b.c": value}`` (lists stay values)."""
    if not isinstance(obj, dict):
        return {prefix: obj} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in obj.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


def read_config(directory: Path) -> dict[str, Any]:
    """A run's ``config.yaml``, flattened, without the keys that are not part of a configuration.

    Raises:
        RunFileError: The file is damaged (not YAML, not a mapping, past a bound of :mod:`lnstab.safeload`, a section
            of :data:`CONFIG_GROUPS` not a mapping, a model argument of a type GPTModule does not take).
    """
    path = directory / CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        data = load_yaml(path) or {}
    except DataFileError as exc:
        raise RunFileError.of(path, exc) from None
    if not isinstance(data, dict):
        raise RunFileError(path, f"it holds a YAML {type(data).__name__}, not a config (a mapping)")
    for group, value in data.items():
        if group in CONFIG_GROUPS and value is not None and not isinstance(value, dict):
            raise RunFileError(path, f"'{group}' holds {shown(value)}, not a config section (a mapping)")
    for name, value in (data.get("model") or {}).items():
        if (takes := argument_type(str(name), value)) is not None:
            raise RunFileError(path, f"'model.{name}' holds {shown(value)}, not {takes}")
    return {k: v for k, v in flatten(data).items() if not k.startswith(IGNORED_PREFIXES)}


def check_event_files(directory: Path, live: bool = False) -> None:
    """Refuse a TensorBoard event file of the run that is not one: empty, cut short inside a record, or a record
    whose length fails its checksum (random bytes, an overwritten file). TensorBoard's reader stops at such a record
    without a word, so the run's scalars would end there unseen. Only the records' frames are read (length and its
    CRC-32C), not their contents. A ``live`` run's newest file may be empty or end inside a record: it is being
    written.

    Raises:
        RunFileError: The first such file, with what is wrong and where.
    """
    files = sorted(directory.glob(EVENT_FILES))
    try:
        newest = max(files, key=lambda p: p.stat().st_mtime) if live and files else None
    except OSError:
        newest = None
    for path in files:
        try:
            problem = _event_file_problem(path, partial_end=path == newest)
        except OSError as exc:
            problem = f"it cannot be read ({exc.strerror or type(exc).__name__})"
        if problem:
            raise RunFileError(path, problem)


def _event_file_problem(path: Path, partial_end: bool) -> str | None:
    """What is wrong with the frames of one event file, or ``None`` (``partial_end``: a file being written, which
    may be empty or end inside a record)."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    size = path.stat().st_size
    if size == 0:
        return None if partial_end else "it is empty, not a TensorBoard event file (one starts with a version record)"
    with open(path, "rb") as f:
        offset = 0
        while offset < size:
            f.seek(offset)
            frame = f.read(12)  # the record's length (8 bytes, little-endian) and its masked CRC-32C (4 bytes)
            if len(frame) == 12 and masked_crc32c(frame[:8]) != struct.unpack("<I", frame[8:])[0]:
                return f"the record at byte {offset} fails its length checksum: not a TensorBoard event file, or " \
                       f"overwritten"
            end = offset + 12 + (struct.unpack("<Q", frame[:8])[0] if len(frame) == 12 else 0) + 4
            if len(frame) < 12 or end > size:
                return None if partial_end else f"it ends inside its record at byte {offset} of {size} (cut short)"
            offset = end
    return None


def _finite(value: Any) -> float | None:
    return float(value) if is_number(value) and math.isfinite(value) else None


def _step(value: Any) -> int | None:
    return value if is_integer(value) else None


def read_run(directory: Path) -> RunRecord:
    """A :class:`RunRecord` of an lnstab run directory (``damaged``, with its ``problem``, when a file is)."""
    try:
        config = read_config(directory)
    except RunFileError as exc:
        return RunRecord(name=directory.name, path=directory, status="damaged", problem=str(exc), _scalars={})
    try:
        summary = read_summary(directory)
        record = fit_eval(directory)
        hidden, events = read_hidden_series(directory), read_events(directory)
    except RunFileError as exc:
        return RunRecord(name=directory.name, path=directory, status="damaged", config=config, problem=str(exc),
                         _scalars={})
    status = summary.get("status") or "unknown"
    if status == "running" and runlock.abandoned(directory):  # SIGKILLed (or out of memory): not training
        status = "killed"
    try:
        check_event_files(directory, live=status == "running")
    except RunFileError as exc:
        return RunRecord(name=directory.name, path=directory, status="damaged", config=config, problem=str(exc),
                         _scalars={})
    metrics: dict[str, float] = {}
    val = (summary.get("val") or {}).get("loss")
    if _finite(val) is not None:
        metrics["val_loss"] = float(val)
    scores = (record or {}).get("metrics") or summary.get("eval") or {}
    for key, value in (scores.items() if isinstance(scores, dict) else []):
        if _finite(value) is not None:
            metrics[f"eval_{key}" if key == "loss" else key] = float(value)
    copying = (record or {}).get("copying")  # teacher-forced evaluations since eval.json has it
    if isinstance(copying, dict) and _finite(copying.get("rate")) is not None:
        metrics["copy_rate"] = float(copying["rate"])
    return RunRecord(name=directory.name, path=directory, status=status, config=config, summary=summary,
                     metrics=metrics, hidden=hidden, events=events)


def _runs_below(directory: Path) -> list[Path]:
    children = sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))
    # a directory holding nothing but hidden files (a run starting: its .lnstab.lock) is not a run yet, nor a stranger
    others = [p for p in children if not is_run_dir(p) and any(not c.name.startswith(".") for c in p.iterdir())]
    if others:
        raise ReportError(f"{others[0]} is not an lnstab run directory (no config.yaml, summary.json or "
                          f"checkpoints/), in {directory}")
    return [p for p in children if is_run_dir(p)]


def _stderr(line: str) -> None:
    print(f"lnstab report: {line}", file=sys.stderr)


def collect(paths: list[str | Path], warn: Callable[[str], None] = _stderr) -> list[RunRecord]:
    """The runs under ``paths`` (run directories or directories of runs), in the order given, no duplicates.

    Args:
        paths: Run directories or directories of runs.
        warn: Gets one line per damaged run and per damaged manifest (default: stderr).

    Raises:
        ReportError: A path that does not exist, or is neither a run directory nor a directory of runs (one line
            naming it).
    """
    records: list[RunRecord] = []
    seen: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if not path.is_dir():
            raise ReportError(f"{path} is not a directory; give lnstab run directories or directories of runs")
        if is_run_dir(path):
            found, manifest = [path], None
        else:
            found = _runs_below(path)
            try:
                manifest = read_manifest(path)
            except RunFileError as exc:
                warn(f"{exc}; left out: runs it planned that have no directory are not counted")
                manifest = None
            if not found and not manifest:
                raise ReportError(f"{path} is not an lnstab run directory, nor a directory of runs (no config.yaml, "
                                  f"summary.json or checkpoints/ in it or its subdirectories)")
        batch = []
        for run in found:
            if run.resolve() not in seen:
                seen.add(run.resolve())
                batch.append(read_run(run))
        for r in batch:
            if r.problem:
                warn(f"{r.problem}; {r.name} is counted as a damaged run")
        if manifest:
            _fill_damaged(manifest, batch)
            here = path.resolve()  # this grid's runs given earlier on the command line are present, not missing
            earlier = [r for r in records if r.path.resolve().parent == here]
            batch += _missing(path, manifest, batch + earlier)
            order = {name: i for i, (name, _) in enumerate(manifest_runs(manifest))}
            batch.sort(key=lambda r: order.get(r.name, len(order)))  # the grid's order; others after, by name
        records += batch
    return records


def _fill_damaged(manifest: dict[str, Any], batch: list[RunRecord]) -> None:
    """A damaged run whose config could not be read takes the grid's base config with its own overrides (as a
    missing run does), so it counts in its own configuration."""
    overrides = dict(manifest_runs(manifest))
    base = _base_config(batch, overrides)
    for r in batch:
        if r.status == "damaged" and not r.config and r.name in overrides:
            r.config = _planned_config(overrides[r.name], base)


def _base_config(present: list[RunRecord], overrides: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The config the grid's runs share before their own overrides: a present run's, where every key its overrides
    set is taken from a present run whose overrides leave that key alone (the base value), or dropped when every run
    sets it. A sibling's config as it is would lend a run the sibling's own overrides (a QK-norm run's
    ``qk_norm: true`` to a Peri-LN run that never set it)."""
    healthy = [r for r in present if r.config and r.status != "damaged"]
    if not healthy:
        return None
    flat = {r.name: _flat_keys(overrides.get(r.name, {})) for r in healthy}
    first = healthy[0]
    base = dict(first.config)
    for key in flat[first.name]:
        donor = next((r for r in healthy if key not in flat[r.name] and key in r.config), None)
        if donor is None:
            base.pop(key, None)
        else:
            base[key] = donor.config[key]
    return base


def _flat_keys(overrides: dict[str, Any]) -> set[str]:
    keys: set[str] = set()
    for key, value in overrides.items():
        keys |= set(flatten(value, key)) if isinstance(value, dict) else {key}
    return keys


def _planned_config(overrides: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    config = dict(base) if base else {}
    for key, value in overrides.items():
        flat = flatten(value, key) if isinstance(value, dict) and base else {key: value}
        config.update({k: v for k, v in flat.items() if not k.startswith(IGNORED_PREFIXES)})
    return config


def _missing(directory: Path, manifest: dict[str, Any], present: list[RunRecord]) -> list[RunRecord]:
    """Runs the sweep's manifest names that have no run directory: their config is the grid's base config
    (:func:`_base_config`) with their own overrides, or just the overrides when no run is present."""
    have = {r.name for r in present}
    base = _base_config(present, dict(manifest_runs(manifest)))
    out = []
    for name, overrides in manifest_runs(manifest):
        if name not in have:
            out.append(RunRecord(name=name, path=directory / name, status="missing",
                                 config=_planned_config(overrides, base)))
    return out
