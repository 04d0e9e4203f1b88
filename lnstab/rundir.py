"""The layout of a run directory, in one place: what each file is called, how it is written and read.

A run directory is what ``lnstab fit`` writes (``runs/<experiment>/version_N/``, or ``--run_dir DIR``; sweeps use
``runs/<grid>/<run>/``)::

    config.yaml                 the resolved config (no ``extends``): ``lnstab fit --config config.yaml`` reruns it
    summary.json                the run's state (schema below), rewritten atomically as the run goes
    divergence_events.jsonl     one JSON object per divergence event (DivergenceMonitor)
    hidden_stats.json           the hidden-state series (HiddenStateStatistics): {"tags", "steps", "stats"}
    eval.json, eval-1.json, …   final evaluations (FinalEvaluation, ``lnstab evaluate``); never overwritten
    events.out.tfevents.*       TensorBoard scalars (every tag in the README's tag guide)
    checkpoints/*.ckpt          Lightning checkpoints (files; directories for sharded FSDP checkpoints)

``summary.json`` (one object; every key optional, readers must tolerate missing ones)::

    status            "running" | "completed" | "diverged" | "interrupted" | "failed"
    final_step        optimizer steps done when the run ended
    diverged_step     step of the first fatal divergence event (null if none)
    divergence_events number of events recorded
    interrupted_step, signal        set when a signal stopped the run (status "interrupted")
    error             "<ExceptionType>: message" (status "failed")
    val               {"loss", "ppl", "step"}: the latest validation result
    eval              the latest final evaluation's metrics + {"protocol", "file"}
    started_at, ended_at (ISO 8601, UTC), wall_s (seconds of this process, summed over resumptions)

Writers: :func:`update_summary` (inside a run, rank zero) and :func:`merge_summary` (anywhere). Every file is
written through :func:`atomic_write_text`, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning.pytorch as pl

CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
EVENTS_FILE = "divergence_events.jsonl"
HIDDEN_SERIES_FILE = "hidden_stats.json"
EVAL_FILE = "eval.json"
CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
STATUSES = ("running", "completed", "diverged", "interrupted", "failed")


def run_dir(trainer: pl.Trainer) -> Path:
    """The run's directory: the first logger's ``log_dir`` where there is one, else ``trainer.default_root_dir``.

    Same rule as ``trainer.log_dir`` but without its ``strategy.broadcast``: this is called from rank-zero-only
    code, where a collective would hang (or crash) the other ranks.
    """
    if trainer.loggers:
        logger = trainer.loggers[0]
        directory = getattr(logger, "log_dir", None) or logger.save_dir
        if directory:
            return Path(directory)
    return Path(trainer.default_root_dir)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` through a temporary file *in the same directory*, fsync, ``os.replace``.

    Readers see the old file or the new one, never half of one, on any filesystem (the temporary file never
    crosses a filesystem boundary); on failure the temporary file is removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp creates 0600; results are meant to be read by others
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: str | os.PathLike) -> None:
    """Flush a directory entry (the rename) to disk where the platform allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write_bytes` for UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"))


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by the string ``"nan"``, ``"inf"`` or ``"-inf"`` (strict JSON
    has no such numbers; a diverged run has them). :func:`read_json` gives them back as floats."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """``obj`` as indented strict JSON (non-finite numbers as strings, see :func:`json_safe`), atomically."""
    text = json.dumps(json_safe(obj), indent=2, sort_keys=True, default=str, allow_nan=False)
    atomic_write_text(path, text + "\n")


NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def read_json(path: str | os.PathLike, numbers: bool = True) -> Any:
    """The JSON in ``path`` (``None`` when the file does not exist); with ``numbers`` the strings ``"nan"``,
    ``"inf"``, ``"-inf"`` that :func:`json_safe` wrote come back as floats."""
    path = Path(path)
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return _restore(data) if numbers else data


def _restore(obj: Any) -> Any:
    if isinstance(obj, str):
        return NONFINITE.get(obj, obj)
    if isinstance(obj, dict):
        return {k: _restore(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_restore(v) for v in obj]
    return obj


def read_summary(directory: str | os.PathLike) -> dict[str, Any]:
    """The run summary in ``directory`` (``{}`` when there is none yet)."""
    return read_json(Path(directory) / SUMMARY_FILE) or {}


def merge_summary(directory: str | os.PathLike, **fields: Any) -> dict[str, Any]:
    """Merge ``fields`` into ``directory/summary.json`` (nested dicts merged one level); returns the new summary."""
    summary = read_summary(directory)
    for key, value in fields.items():
        if isinstance(value, dict) and isinstance(summary.get(key), dict):
            summary[key] = {**summary[key], **value}
        else:
            summary[key] = value
    write_json(Path(directory) / SUMMARY_FILE, summary)
    return summary


def update_summary(trainer: pl.Trainer, **fields: Any) -> None:
    """:func:`merge_summary` into the run directory of ``trainer``, on global rank zero only."""
    if trainer.is_global_zero:
        merge_summary(run_dir(trainer), **fields)


def read_events(directory: str | os.PathLike) -> list[dict[str, Any]]:
    """The divergence events of a run (``[]`` when none were recorded)."""
    path = Path(directory) / EVENTS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def read_hidden_series(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The hidden-state series ``{"tags", "steps", "stats": {stat: {tag: [values]}}}`` or ``None``."""
    return read_json(Path(directory) / HIDDEN_SERIES_FILE)


def eval_files(directory: str | os.PathLike) -> list[Path]:
    """``eval.json``, ``eval-1.json``, … of a run, oldest first."""
    directory = Path(directory)
    found = [p for p in directory.glob("eval*.json") if p.name == EVAL_FILE or p.stem.removeprefix("eval-").isdigit()]
    return sorted(found, key=lambda p: 0 if p.name == EVAL_FILE else int(p.stem.removeprefix("eval-")))


def latest_eval(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The newest final evaluation record of a run, or ``None``."""
    files = eval_files(directory)
    return read_json(files[-1]) if files else None


def checkpoint_dir(directory: str | os.PathLike) -> Path:
    """Where a run's checkpoints live."""
    return Path(directory) / CHECKPOINT_DIR


def is_run_dir(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` looks like an lnstab run (a config, a summary or a checkpoint directory)."""
    directory = Path(directory)
    return any((directory / name).exists() for name in (CONFIG_FILE, SUMMARY_FILE, CHECKPOINT_DIR))
